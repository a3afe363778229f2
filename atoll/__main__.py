import sys

from atoll.cli import main

sys.exit(main())
