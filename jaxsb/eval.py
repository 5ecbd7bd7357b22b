"""`python -m jaxsb.eval`: perplexity and long-range tasks of a pretrained or trained model.

    python -m jaxsb.eval --set model.init=smollm2-135m --text FILE
    python -m jaxsb.eval --set model.init=smollm2-135m --long-docs 4 --max-doc-tokens 16384
    python -m jaxsb.eval --set model.init=smollm2-135m --task passkey --lengths 1024,2048,4096,8192 --samples 6
    python -m jaxsb.eval --workdir runs/default-... --prompts FILE.jsonl --out results.jsonl
    python -m jaxsb.eval --workdir runs/mqar-... --task mqar --samples 64

A model comes from `--workdir` (a trained run: its last checkpoint and saved config, `--set`
applied on top, e.g. `--set model.attention=sparse`) or from `model.init`. Texts are scored in
windows of the model's context (`--context`, default the longest of `data.max_len` and the
pretrained model's trained context); every token after the first of a window is predicted.
Generation is greedy with a KV cache: prefill under the configured attention (dense or sparse,
`model.sparse.policy=floor` for the runtime floor alone), dense decode steps
(jaxsb/models/decode.py). Every task prints the attention work of its prefills / windows (block
pairs as a fraction of dense causal) and, when sparse, the routing coverage; its last line is
`perplexity: X` or `accuracy: X`. `--task mqar` scores multi-query associative recall
(jaxsb/data/mqar.py; the run's data.mqar settings, examples of a seed apart from training's),
teacher-forced: the share of queried values predicted right. `--summary FILE.json` also writes the results as JSON.
The libraries behind it: jaxsb/training/evaluation.py and jaxsb/evals/.
"""

from __future__ import annotations

import json
import math
import sys

from jaxsb.cli import base_parser, load_model


def _parser():
    parser = base_parser("Perplexity and long-range tasks (passkey, prompts) of a jaxsb model.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="perplexity of one UTF-8 text file")
    what.add_argument("--long-docs", type=int, metavar="N",
                      help="perplexity over the N longest Python standard-library source files")
    what.add_argument("--task", choices=["passkey", "mqar"], help="a generated long-range task")
    what.add_argument("--prompts", metavar="FILE.jsonl",
                      help='records {"prompt", "answer", optional "id"}: correct when the greedy '
                           "continuation contains the answer")
    parser.add_argument("--lengths", default=None,
                        help="passkey: prompt lengths in tokens (default 1024,2048,4096,8192); "
                             "mqar: example lengths (default the run's data.mqar.lengths)")
    parser.add_argument("--samples", type=int, default=6,
                        help="passkey: prompts per length (evenly spread depths); mqar: examples per length")
    parser.add_argument("--seed", type=int, default=0, help="passkey: seed of the keys; mqar: of the examples")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens generated per prompt")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts generated together")
    parser.add_argument("--max-doc-tokens", type=int, default=0,
                        help="long-docs: score only the first M tokens of each file (0 = all; counted)")
    parser.add_argument("--context", type=int, default=0,
                        help="positions a window or prompt may use (0 = the model's: see above)")
    parser.add_argument("--out", help="prompts / passkey: per-record results as JSON lines")
    parser.add_argument("--summary", metavar="FILE.json", help="write the results as JSON")
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: {e}") from None


def _perplexity(model, tokenizer, named_paths: list[tuple[str, str]], context: int, max_tokens: int, work):
    """(lines, summary) of window perplexity over the files; the last line is `perplexity: X`."""
    from jaxsb.training.evaluation import window_nll

    lines, docs, total, count = [], [], 0.0, 0
    for flag, path in named_paths:
        ids = tokenizer.encode(_read_text(path, flag))
        if len(ids) < 2:
            raise ValueError(f"{flag} {path}: {len(ids)} tokens; need at least 2")
        cut = max(0, len(ids) - max_tokens) if max_tokens else 0
        ids = ids[: len(ids) - cut]
        s, n = window_nll(model, ids, context, work)
        total, count = total + s, count + n
        docs.append({"path": path, "tokens": len(ids), "cut_tokens": cut, "perplexity": math.exp(s / n)})
        lines.append(f"{path}: tokens {len(ids)} (scored {n}" + (f"; {cut} more not scored" if cut else "")
                     + f"), perplexity {math.exp(s / n):.4f}")
    lines += work.lines() + [f"tokens: {sum(d['tokens'] for d in docs)} (scored {count})",
                             f"perplexity: {math.exp(total / count):.4f}"]
    return lines, {"perplexity": math.exp(total / count), "scored": count, "documents": docs}


def _generate(model, tokenizer, prompts: list[list[int]], args, work) -> list[str]:
    from jaxsb.training.evaluation import generate_all

    outs = generate_all(model, prompts, args.max_new_tokens, eos_id=tokenizer.eos_id,
                        batch_size=args.batch_size, work=work)
    return [tokenizer.decode([t for t in out if t != tokenizer.eos_id]) for out in outs]


def _passkey(model, tokenizer, args, context: int, work):
    from jaxsb.evals import passkey
    from jaxsb.evals.prompts import PromptRecord, write_results

    lengths = _lengths(args.lengths or "1024,2048,4096,8192")
    too_long = [L for L in lengths if L > context]
    if too_long:
        raise ValueError(f"--lengths {','.join(map(str, lengths))}: {too_long} exceed the model's context {context} "
                         "(--context or data.max_len)")
    samples = passkey.make_samples(tokenizer, lengths, args.samples, args.seed, reserve=args.max_new_tokens)
    continuations = _generate(model, tokenizer, [tokenizer.encode(s.prompt) for s in samples], args, work)
    correct = [passkey.is_correct(s, c) for s, c in zip(samples, continuations)]
    summary = passkey.summarize(samples, correct)
    if args.out:
        records = [PromptRecord(s.id, s.prompt, s.key, i + 1) for i, s in enumerate(samples)]
        write_results(args.out, records, continuations, correct)
    lines = passkey.format_table(summary) + work.lines() + [passkey.accuracy_line(correct)]
    by_length = {str(k): v for k, v in summary["by_length"].items()}
    return lines, {"accuracy": summary["accuracy"], "by_length": by_length,
                   "by_length_depth": {str(L): {f"{d:.2f}": a for d, a in row.items()}
                                       for L, row in summary["by_length_depth"].items()}}


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text}: expected comma-separated positive token counts")
    return lengths


def _mqar(model, cfg, args, context: int, work):
    from jaxsb.data.mqar import EVAL_SEED_OFFSET, examples
    from jaxsb.training.evaluation import mqar_recall

    m = cfg.data.mqar
    if m.vocab > model.cfg.vocab_size:
        raise ValueError(f"data.mqar.vocab={m.vocab} ids do not fit the model's vocabulary of {model.cfg.vocab_size}")
    lengths = _lengths(args.lengths) if args.lengths else list(m.lengths)
    if max(lengths) > context:
        raise ValueError(f"--lengths {lengths}: longer than the model's context {context}")
    lines, by_length, correct, total = [], {}, 0, 0
    for L in lengths:
        batch = examples(cfg.data.seed + EVAL_SEED_OFFSET + args.seed, [L], args.samples, m.kv_fraction, m.vocab)
        c, n = mqar_recall(model, batch, args.batch_size, work)
        correct, total = correct + c, total + n
        by_length[str(L)] = c / n
        lines.append(f"length {L}: recalled {c} of {n} values ({c / n:.4f}) in {args.samples} examples")
    return lines + work.lines() + [f"accuracy: {correct / total:.4f}"], {"accuracy": correct / total,
                                                                         "by_length": by_length}


def _prompts(model, tokenizer, args, context: int, work):
    from jaxsb.evals.prompts import check_lengths, load_prompts, write_results
    from jaxsb.evals.scoring import accuracy_line, contains_answer

    records = load_prompts(args.prompts)
    ids = check_lengths(records, tokenizer, context, args.max_new_tokens, args.prompts)
    continuations = _generate(model, tokenizer, ids, args, work)
    correct = [contains_answer(r.answer, c) for r, c in zip(records, continuations)]
    if args.out:
        write_results(args.out, records, continuations, correct)
    lines = [f"{r.id}: {'correct' if ok else 'wrong'} {c!r}" for r, c, ok in zip(records, continuations, correct)]
    return lines + work.lines() + [accuracy_line(correct)], {"accuracy": sum(correct) / len(correct)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.long_docs is not None and args.long_docs < 1:
        return _fail(f"--long-docs {args.long_docs}: must be >= 1")
    if args.max_new_tokens < 1 or args.batch_size < 1 or args.samples < 1:
        return _fail("--max-new-tokens, --batch-size and --samples must be >= 1")
    if args.text:  # a missing or undecodable file fails before the model loads
        try:
            _read_text(args.text, "--text")
        except ValueError as e:
            return _fail(str(e))
    model, tokenizer, cfg = load_model(args)
    from jaxsb.evals.prompts import PromptsError
    from jaxsb.evals.long_docs import longest_stdlib_files
    from jaxsb.training.evaluation import AttentionWork, model_context

    context = args.context or model_context(cfg)
    work = AttentionWork()
    try:
        if args.text:
            lines, result = _perplexity(model, tokenizer, [("--text", args.text)], context, 0, work)
        elif args.long_docs:
            paths = [("--long-docs", p) for p in longest_stdlib_files(args.long_docs)]
            lines, result = _perplexity(model, tokenizer, paths, context, args.max_doc_tokens, work)
        elif args.task == "passkey":
            lines, result = _passkey(model, tokenizer, args, context, work)
        elif args.task == "mqar":
            lines, result = _mqar(model, cfg, args, context, work)
        else:
            lines, result = _prompts(model, tokenizer, args, context, work)
    except (PromptsError, ValueError) as e:
        return _fail(str(e))
    print("\n".join(lines))
    if args.summary:
        m = cfg.model
        setting = {"attention": m.attention, "block_size": m.sparse.block_size, "top_k": m.sparse.top_k,
                   "policy": m.sparse.policy, "coverage_drop": m.sparse.coverage_drop, "context": context}
        with open(args.summary, "w") as f:
            json.dump({"setting": setting, **result, "work": work.summary()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
