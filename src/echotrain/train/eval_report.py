"""The terminal report of ``echotrain eval``: what was evaluated, how, the numbers, and (when
nothing was correct) a few completions so the user sees why."""

from __future__ import annotations

from typing import Any, Sequence


def print_eval_report(model: str, task: str, params: dict[str, Any], res: dict[str, float],
                      samples: Sequence[dict[str, Any]], console: Any = None) -> None:
    """Print the header lines, the metrics table and ``samples`` (rich, to stdout).

    Args:
        model: description of the model (path or name; printed whole, never wrapped mid-word).
        task: task name. params: ``temperature``, ``max_new_tokens``, ``seed`` (and ``decode_loop``,
            ``sampler`` when given).
        res: :func:`echotrain.train.evaluate.evaluate`'s result (floats) plus ``seconds``.
        samples: completions to show (question, answer, completion, correct, truncated).
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    temp = params["temperature"]
    decoding = "greedy (temperature 0)" if temp == 0 else f"sampling at temperature {temp:g}"
    console.print(Text(f"echotrain eval\n  model: {model}\n  task:  {task}, {int(res['num_prompts'])} prompts x "
                       f"{int(res['n'])} samples, {decoding}, at most {params['max_new_tokens']} new tokens, "
                       f"seed {params['seed']}" + (f", decode_loop {params['decode_loop']}, sampler {params['sampler']}"
                                                   if "decode_loop" in params else "")), soft_wrap=True)
    table = Table()
    table.add_column("metric", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    for k, v in res.items():
        if k in ("num_prompts", "n"):
            continue
        table.add_row(k, f"{v:.4g}")
    console.print(table)
    if res.get("truncated_frac", 0) >= 0.5:
        console.print(Text(f"{res['truncated_frac']:.0%} of completions hit the {params['max_new_tokens']}-token limit "
                           "before an answer could end: raise --max-new-tokens (GSM8K/MATH need 256 or more)."),
                      soft_wrap=True)
    if samples:
        console.print(Text(f"{len(samples)} completion(s), one per prompt:"))
        for i, s in enumerate(samples, 1):
            verdict = "correct" if s["correct"] >= 1 else "wrong"
            if s.get("truncated"):
                verdict += ", hit the token limit"
            console.print(Text(f"--- {i}. gold answer {s['answer']!r} ({verdict})\nQ: {s['question']}\nA: {s['completion']}"),
                          soft_wrap=True)
