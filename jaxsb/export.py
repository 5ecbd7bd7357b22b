"""`python -m jaxsb.export`: a jaxsb model as a Hugging Face checkpoint directory.

    python -m jaxsb.export --workdir runs/default-... --out HF_DIR      # a run's last checkpoint
    python -m jaxsb.export --set model.init=hf:DIR --out HF_DIR         # or any model.init

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json (jaxsb/models/hf_export.py) that transformers' AutoModelForCausalLM
and AutoTokenizer load, and that `--set model.init=hf:HF_DIR` loads back unchanged.
"""

from __future__ import annotations

import os
import sys

from jaxsb.cli import base_parser, load_model


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("Write a jaxsb model as a Hugging Face checkpoint directory.")
    parser.add_argument("--out", required=True, help="directory to write (created; existing files are replaced)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the saved weights")
    args = parser.parse_args(argv)
    if os.path.isfile(args.out):
        print(f"error: --out {args.out} is a file, expected a directory", file=sys.stderr)
        return 2
    model, tokenizer, cfg = load_model(args)
    from jaxsb.models.hf_export import write_hf_checkpoint
    from jaxsb.models.pretrained import export_params
    from jaxsb.training.evaluation import model_context

    files = write_hf_checkpoint(args.out, model.cfg, export_params(model), tokenizer.hf, tokenizer.bos_id,
                                tokenizer.eos_id, max_positions=model_context(cfg),
                                chat_template=tokenizer.chat_template, dtype=args.dtype)
    print(f"wrote {', '.join(f.name for f in files)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
