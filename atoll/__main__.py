"""`python -m atoll`: the `atoll` command. An entry point, not library code: the core itself imports no
component, this file only hands over to the command line in `atoll.launch`."""

import sys

from atoll.launch.cli import main

sys.exit(main())
