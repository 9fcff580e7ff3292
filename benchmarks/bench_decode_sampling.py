"""The per-step vocabulary work of echotrain's decode loop, before and after issue 36 item 12's change, in
one process, alternating, as ratios; beside it one decode forward of the default model at the same rows.

Per decode step the loop turns the (N, V) logits into a token and the sampler's statistics (log-prob,
entropy, sum of squared probabilities). Before: the logits copied for the warpers even when there are none,
a softmax, an (N, V) float64 copy and a sequential float64 cumulative sum over V (inverse CDF), a
log-softmax, and one ``exp`` each for the entropy and the squared probabilities. After
(``echotrain.runtime.decode``): no copy without warpers, the inverse CDF in two levels (float64 sums of
256-token blocks, then one block's cumulative sum), one ``exp`` for both statistics. Both draw the same
tokens for the same RNG state (checked each round). Printed: the median milliseconds of each at N rows
(V = 49,152, SmolLM2's vocabulary, temperature 1, no top-k / top-p), their ratio, and the median time of
one decode forward of SmolLM2-135M-Instruct at N rows with a 96-position KV cache (what the saving is
a part of).

    python benchmarks/bench_decode_sampling.py --threads 2 --reps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def before(logits, torch):
    """The decode step's vocabulary work as it was (commit 87fb47a), kept here as the baseline."""
    probs = torch.softmax(logits.clone(), dim=-1)
    cdf = probs.double().cumsum(-1)
    u = torch.rand(len(probs), 1, dtype=torch.float64) * cdf[:, -1:]
    nxt = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    lp = torch.log_softmax(logits, dim=-1)
    lp_tok = lp.gather(-1, nxt[:, None]).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    sq = (2.0 * lp).exp().sum(-1)
    return nxt, lp_tok, ent, sq


def after(logits, torch):
    from echotrain.runtime.decode import distribution_stats, inverse_cdf_sample

    nxt = inverse_cdf_sample(torch.softmax(logits, dim=-1))
    lp = torch.log_softmax(logits, dim=-1)
    ent, sq = distribution_stats(lp)
    return nxt, lp.gather(-1, nxt[:, None]).squeeze(-1), ent, sq


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="64,32,8", help="comma-separated row counts N")
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--no-model", action="store_true", help="skip the decode forward (no model load)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model = None
    if not args.no_model:
        from echotrain.models import load_policy

        model, _ = load_policy(None)
        model.eval()
    results = {}
    for n in (int(r) for r in args.rows.split(",")):
        g = torch.Generator().manual_seed(n)
        logits = torch.randn(n, args.vocab, generator=g) * 4
        times = {"before": [], "after": []}
        same = True
        for r in range(args.reps + 1):
            outs = {}
            for name, fn in ((("before", before), ("after", after)) if r % 2 == 0 else (("after", after), ("before", before))):
                torch.manual_seed(r)
                t = time.perf_counter()
                outs[name] = fn(logits, torch)
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t)
            same &= bool(torch.equal(outs["before"][0], outs["after"][0]))
        row = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row["ratio"] = row["after"] / row["before"]
        row["same_tokens"] = same
        if model is not None:
            from transformers import DynamicCache

            with torch.inference_mode():
                ids = torch.randint(0, 1000, (n, 96))
                out = model(input_ids=ids, use_cache=True, past_key_values=DynamicCache())
                cache, fwd = out.past_key_values, []
                for _ in range(5):
                    t = time.perf_counter()
                    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)
                    fwd.append(time.perf_counter() - t)
                    cache.crop(-1)  # back to the 96 positions
            row["forward_ms"] = statistics.median(fwd) * 1e3
            row["saved_share_of_step"] = (row["before"] - row["after"]) / (row["forward_ms"] + row["before"])
        results[n] = row
        print(f"N={n:3d}  before {row['before']:7.2f} ms  after {row['after']:7.2f} ms  ratio {row['ratio']:.2f}  "
              f"same tokens {same}" + (f"  decode forward {row['forward_ms']:7.1f} ms  saved {row['saved_share_of_step']:.1%} of "
                                       "the step" if model is not None else ""))
    return results


if __name__ == "__main__":
    main()
