"""Cost of recording ``rollout_log_prob`` inside generation, as a ratio to plain ``generate``.

Each round runs ``model.generate`` (sampling, KV cache) on the same prompts with and without
:class:`echotrain.runtime.rollout.RolloutLogProbRecorder`, in shuffled order, under the same seed;
reports the fastest of the rounds (process CPU time) and the ratio. A noise-control row runs the
baseline twice.

    python benchmarks/bench_rollout_log_prob.py --model smollm2 --rows 16 --tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "testbed"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from echotrain.runtime.rollout import RolloutLogProbRecorder, encode_prompts, render_prompts

    if args.model == "testbed":
        from echotrain.models.testbed import load_testbed

        model, tok = load_testbed()
        prompts = ["12+7="] * args.rows
    else:
        from echotrain.models.hf import load_policy

        model, tok = load_policy()
        prompts = [[{"role": "user", "content": "Count from one to fifty in words."}]] * args.rows
    model.eval()
    ids, attn = encode_prompts(tok, render_prompts(tok, prompts), tok.pad_token_id or 0)
    kw = dict(attention_mask=attn, max_new_tokens=args.tokens, do_sample=True, temperature=1.0, top_p=1.0,
              pad_token_id=tok.pad_token_id or 0, eos_token_id=None, use_cache=True)
    if args.model == "smollm2":
        kw["min_new_tokens"] = args.tokens  # fixed length: both variants generate the same number of tokens

    def run(record: bool) -> float:
        torch.manual_seed(0)
        t0 = time.process_time()
        with torch.inference_mode():
            rec = RolloutLogProbRecorder(model, 1.0) if record else None
            with rec or contextlib.nullcontext():
                out = model.generate(ids, **kw)
            if rec is not None:
                rec.finish(out[:, ids.shape[1]:])
        return time.process_time() - t0

    cases = {"generate (baseline)": False, "generate (baseline again: noise control)": False,
             "generate + rollout_log_prob recorder": True}
    times: dict[str, list[float]] = {c: [] for c in cases}
    run(False)  # warm-up
    for _ in range(args.rounds):
        order = list(cases)
        random.shuffle(order)
        for c in order:
            times[c].append(run(cases[c]))
    base = min(times["generate (baseline)"])
    print(f"| case | min CPU s | ratio (min) |  ({args.model}, {args.rows} rows x {args.tokens} tokens)")
    print("|---|---|---|")
    for c, ts in times.items():
        print(f"| {c} | {min(ts):.3f} | {min(ts) / base:.3f} |")


if __name__ == "__main__":
    main()
