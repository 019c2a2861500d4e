"""`python -m foresight.training …`: the training commands (train, eval-drafter, eval-foresight) and
prepare-model without the serving stack (fastapi, pydantic, uvicorn), for a training machine that has only
torch and transformers. Same arguments as `foresight train …`."""
from __future__ import annotations

import argparse
import sys

from .cli import add_train_args, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foresight.training",
                                     description="train and evaluate drafters for Foresight")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-model", help="convert the embedded default model into its cache folder")
    add_train_args(sub)
    args = parser.parse_args(argv)
    if args.command == "prepare-model":
        from ..models.loading import prepare_default_model

        print(prepare_default_model())
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
