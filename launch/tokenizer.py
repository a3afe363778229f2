"""`atoll tokenizer train`: a byte-level BPE trained on local text, JSONL, Parquet or `datasets` folders."""

from __future__ import annotations

import argparse

from atoll.argtypes import count


def register(sub) -> None:  # type: ignore[no-untyped-def]
    p = sub.add_parser("tokenizer", help="train a tokenizer for a job's [data] tokenizer",
                       description="Tokenizers for `[data] tokenizer = \"path/tokenizer.json\"`.")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="COMMAND", required=True)
    t = tsub.add_parser(
        "train", help="train a byte-level BPE on local files",
        description="Train a byte-level BPE (Hugging Face tokenizers) on local text, JSONL, Parquet files or "
        "datasets.save_to_disk folders, read a chunk at a time, and write its tokenizer.json. Set the job's "
        "model.vocab_size to at least the vocabulary size.")
    t.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                   help="text (.txt), JSONL (.jsonl), Parquet (.parquet) files or datasets folders")
    t.add_argument("--vocab-size", type=count(least=257, most=10_000_000, what="a vocabulary size"), required=True,
                   help="tokens in the vocabulary (at least 257)")
    t.add_argument("--out", required=True, help="where to write tokenizer.json")
    t.add_argument("--field", default="text", help="JSONL key or column holding the text (default: text)")
    t.add_argument("--min-frequency", type=count(least=1, most=2**31, what="an occurrence count"), default=2, help="fewest occurrences of a merged pair (default: 2)")
    t.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from atoll.node.tokenizer import ProgressLine, train_bpe
    from atoll.preflight import check_output_file

    check_output_file(Path(args.out), "--out")  # before the corpus is read, not after
    progress = ProgressLine()
    seen = [0, 0]

    def report(documents: int, nbytes: int) -> None:
        seen[:] = [documents, nbytes]
        progress(documents, nbytes)

    from atoll.node.datasets import DataError

    try:
        tok = train_bpe(args.corpus, vocab_size=args.vocab_size, out=args.out, field=args.field,
                        min_frequency=args.min_frequency, progress=report)
    except DataError as e:  # the data's messages speak of the job spec's [data] field: here it is --field
        raise DataError(str(e).replace("data.field", "--field").replace("set [data] field to", "give --field")
                        .replace("set [data] field", "give --field")) from None
    progress(*seen, final=True)
    print(f"wrote {args.out}: a byte-level BPE of {tok.vocab_size} tokens (end of text: id {tok.eos_id}); use it "
          f"with [data] tokenizer = \"{args.out}\" and model.vocab_size >= {tok.vocab_size}")
    return 0
