"""`python -m jaxsb.eval`: perplexity of a pretrained or trained model on a text file.

    python -m jaxsb.eval --set model.init=smollm2-135m --text FILE
    python -m jaxsb.eval --workdir runs/default-... --text FILE

The text is tokenized as one document and cut into windows of `data.max_len` tokens; every
token after the first of its window is predicted. Prints the token count and, last,
`perplexity: X`. The library behind it is jaxsb/training/evaluation.py.
"""

from __future__ import annotations

import math
import sys

from jaxsb.cli import base_parser, load_model


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("Perplexity of a jaxsb model on a text file.")
    parser.add_argument("--text", required=True, help="UTF-8 text file to score")
    args = parser.parse_args(argv)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: --text {args.text}: {e}", file=sys.stderr)
        return 2
    model, tokenizer, cfg = load_model(args)
    from jaxsb.training.evaluation import window_nll

    ids = tokenizer.encode(text)
    if len(ids) < 2:
        print(f"error: --text {args.text}: {len(ids)} tokens; need at least 2", file=sys.stderr)
        return 2
    total, count = window_nll(model, ids, cfg.data.max_len)
    print(f"tokens: {len(ids)} (scored {count})")
    print(f"perplexity: {math.exp(total / count):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
