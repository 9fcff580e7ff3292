"""``echotrain train env=...`` through the real CLI: multi-turn episodes on the testbed and on the
embedded SmolLM2-135M, offline, with the per-step episode metrics; exact resume; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from echotrain.runtime.checkpoints import latest_checkpoint
from echotrain.train.episodes import EPISODE_METRICS
from echotrain.train.metrics import read_jsonl
from tests.train.test_staleness import cli, strip


TINY = ["model=testbed", "prompts_per_step=2", "num_generations=2", "max_new_tokens=6", "num_mini_batches=1",
        "micro_batch_size=4", "num_threads=1", "eval_prompts=0", "plots=false", "save_final_model=false",
        "progress=false", "seed=0", "log_samples=1"]


def test_calculator_env_on_the_testbed(monkeypatch, tmp_path):
    """One step with the calculator; the held-out evaluation (start and end) plays episodes too."""
    from echotrain.runtime import episodes as episodes_mod

    calls = []
    real = episodes_mod.run_episodes
    monkeypatch.setattr(episodes_mod, "run_episodes", lambda *a, **k: calls.append(k.get("do_sample")) or real(*a, **k))
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "env=calculator", "max_turns=2", "steps=1",
               "save_every=0", "eval_prompts=4", f"output_dir={run}") == 0
    rec = read_jsonl(run / "metrics.jsonl")[0]
    assert set(EPISODE_METRICS) <= set(rec)
    assert rec["episode/turns"] >= 1 and rec["episode/model_tokens"] > 0
    assert [r["step"] for r in read_jsonl(run / "eval.jsonl")] == [0, 1]
    assert calls.count(False) == 2  # the two greedy evaluations ran episodes (the step's rollouts sample)


def test_feedback_episodes_resume_exactly(monkeypatch, tmp_path):
    """Episodes of 2 turns (the feedback environment answers every turn, the reward reads the
    last), ECHO, a fixed lag of 1: resumed from the step-2 checkpoint, step 3 is the uninterrupted
    run's (metrics and samples)."""
    (tmp_path / "parity.py").write_text("def reward(completion, example):\n    return float(len(completion) % 2)\n")
    monkeypatch.chdir(tmp_path)  # a reward that varies within groups: the update is not zero
    args = [*TINY, "task=testbed", "env=feedback", "env_options.message=12+13=", "max_turns=2", "staleness=1",
            "save_every=1", "keep_last=3", "preset=echo", "lr=1e-2", "num_generations=4", "temperature=1.5",
            "reward=parity:reward"]
    full = tmp_path / "full"
    assert cli(monkeypatch, "train", *args, "steps=3", f"output_dir={full}") == 0
    part = tmp_path / "part"
    shutil.copytree(full, part)
    latest_checkpoint(part).unlink()  # as if killed after step 2's checkpoint
    assert cli(monkeypatch, "train", "--resume", str(part)) == 0
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert strip(a) == strip(b) and len(a) == 3
    assert all(r["episode/turns"] == 2 and r["episode/env_token_frac"] > 0 for r in a)
    assert any(r["grad_norm"] > 0 for r in a)  # not vacuous: the policy moved
    # step 1's rollouts were sampled by the learner's weights: the trainer's recomputed old log-probs
    # of the episodes' model tokens are the sampler's (the ids and positions trained are those sampled)
    assert a[0]["rollout_corr/log_prob_abs_diff"] < 1e-5
    samples = read_jsonl(full / "samples.jsonl")
    assert samples == read_jsonl(part / "samples.jsonl")
    assert all("12+13=\n" in r["completion"] for r in samples)  # the whole episode, the feedback's turn included


def test_tools_key_takes_plain_callables(monkeypatch, tmp_path):
    (tmp_path / "my_tools.py").write_text(
        'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: first.\n        b: second.\n    """\n'
        "    return a + b\n")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "tools=[my_tools.py:add]", "steps=1", "save_every=0",
               f"output_dir={run}") == 0
    assert "episode/tool_calls" in read_jsonl(run / "metrics.jsonl")[0]


ROUTED_TASK = """
from echotrain.tasks.base import register_task
from echotrain.tasks.testbed_calc import CalcTestbedTask


class Routed(CalcTestbedTask):
    def __getitem__(self, index):
        ex = super().__getitem__(index)
        ex.metadata["environment"] = "count" if int(ex.question[3]) % 2 else "shout"
        return ex


@register_task("testbed-routed", for_testbed=True)
def _routed(**options):
    return Routed(**options)
"""

TRL_ENVS = """
class Count:
    def reset(self, **row):
        self.n = 0

    def increment(self, step: int) -> int:
        \"\"\"Add to the counter.

        Args:
            step: how much.
        \"\"\"
        self.n += step
        return self.n

    def get_reward(self) -> float:
        return 0.25


class Shout:
    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        \"\"\"Upper-case a text.

        Args:
            text: what.
        \"\"\"
        return text.upper()
"""


def test_trl_several_environments_through_the_cli(monkeypatch, tmp_path):
    """TRL's ``environment_factory={name: factory}`` as ``env_options.factory.NAME=...``: a plugin
    task whose examples carry an ``environment`` field (first operand odd: ``count``) routes each
    episode to its environment (only ``Count`` has ``get_reward``: its episodes get 0.25
    shaping, ``Shout``'s none)."""
    (tmp_path / "routes.py").write_text(ROUTED_TASK)
    (tmp_path / "trl_envs.py").write_text(TRL_ENVS)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "plugins=[./routes.py]", "task=testbed-routed", "env=trl",
               "env_options.factory.count=trl_envs.py:Count", "env_options.factory.shout=trl_envs.py:Shout",
               "max_turns=1", "steps=1", "save_every=0", "prompts_per_step=4", "log_samples=8", f"output_dir={run}") == 0
    rec = read_jsonl(run / "metrics.jsonl")[0]
    samples = read_jsonl(run / "samples.jsonl")
    counted = [int(r["question"][3]) % 2 for r in samples]  # the episodes routed to Count
    assert len(samples) == 8 and 0 < sum(counted) < 8, counted
    assert rec["episode/shaping"] == pytest.approx(0.25 * sum(counted) / 8) and rec["episode/turns"] == 1


def test_verifiers_env_on_the_testbed(monkeypatch, tmp_path):
    """``env=verifiers``: an async verifiers-style environment imported from the working directory
    answers every model turn (its reply reads the episode's state); episodes of 2 turns, the
    reply in the samples."""
    (tmp_path / "vf_retry.py").write_text(
        "class Retry:\n"
        "    async def env_response(self, messages, state):\n"
        "        return [{'role': 'user', 'content': f\"turn {state['turn']}: again\"}]\n\n"
        "def load_environment():\n    return Retry()\n")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "env=verifiers", "env_options.env=vf_retry:load_environment",
               "max_turns=2", "steps=1", "save_every=0", f"output_dir={run}") == 0
    rec = read_jsonl(run / "metrics.jsonl")[0]
    assert set(EPISODE_METRICS) <= set(rec) and rec["episode/tool_errors"] == 0
    assert rec["episode/turns"] == 2 and rec["episode/env_token_frac"] > 0
    assert "turn 1: again\n" in read_jsonl(run / "samples.jsonl")[0]["completion"]


@pytest.mark.parametrize("over, message", [
    (["env=nope"], "env='nope' is not valid; valid: calculator, feedback, python, tools, trl, verifiers"),
    (["env=calculator", "async_rollouts=true"], "async_rollouts=True: true is not supported with env"),
    (["env_options.timeout_s=1"], "env_options={'timeout_s': 1}: is set but env is not"),
    (["env=calculator", "env_options.timeout_s=0"], "env='calculator': timeout_s must be > 0 seconds, got 0"),
    (["env=calculator", "max_turns=0"], "max_turns=0: must be >= 1"),
    (["env=calculator", "env_options.demonstrate=maybe"], "env_options.demonstrate must be true or false, got 'maybe'"),
    (["tools=[nowhere:fn]"], "env='tools': cannot import 'nowhere' for 'nowhere:fn'"),
    (["env=verifiers", "env_options.env=nowhere:fn"], "env='verifiers': cannot import 'nowhere' for 'nowhere:fn'"),
    (["env=calculator", "tools=[x:y]"], "tools=['x:y']: takes env=tools (or no env), not env='calculator'"),
    (["env=calculator", "overlong_buffer_len=2"], "overlong_buffer_len=2: DAPO's overlong penalty"),
    (["env=calculator", "adv_estimator=remax"], "adv_estimator='remax': 'remax' rolls out one greedy single-turn"),
])
def test_bad_env_settings_exit_2_with_one_line(monkeypatch, tmp_path, capsys, over, message):
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", *over, f"output_dir={tmp_path / 'r'}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_calculator_env_on_smollm2(monkeypatch, tmp_path):
    """The embedded SmolLM2-135M-Instruct with the calculator tool on reasoning-gym arithmetic,
    the one-shot exchange shown as a worked tool use (``env_options.demonstrate``): 1 step, 2
    prompts x 2 episodes of at most 2 turns (about a minute on a loaded core)."""
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", "env=calculator", "env_options.demonstrate=true", "task=rg:basic_arithmetic", "steps=1", "prompts_per_step=2",
               "num_generations=2", "max_new_tokens=24", "max_turns=2", "num_mini_batches=1", "micro_batch_size=4",
               "num_threads=1", "eval_prompts=0", "plots=false", "save_final_model=false", "save_every=0",
               "progress=false", "log_samples=1", f"output_dir={run}") == 0
    rec = read_jsonl(run / "metrics.jsonl")[0]
    assert set(EPISODE_METRICS) <= set(rec) and rec["episode/model_tokens"] > 0
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert isinstance(sample["completion"], str)


def test_group_rng_episodes_do_not_depend_on_the_split():
    """rollout_rng=group: a prompt group's episodes are the same whether played with the others
    or alone (its own seed), as single-turn rollouts."""
    import torch

    from echotrain.models import load_policy
    from echotrain.tasks import get_task
    from echotrain.train.config import TrainConfig
    from echotrain.train.episodes import EpisodeRollouts

    model, tok = load_policy("testbed")
    cfg = TrainConfig(model="testbed", task="testbed-calc", env="feedback", rollout_rng="group", num_generations=2,
                      max_new_tokens=6, max_turns=2, seed=3, temperature=1.5)
    er = EpisodeRollouts(cfg, model, tok, pad_id=0)
    ex = get_task("testbed-calc").sample(3, 0)
    whole, texts = er.run(ex, range(0, 3), 0, draw=5)
    alone, texts_alone = er.run(ex[2:], range(2, 3), 0, draw=5)
    w = alone.response_ids.shape[1]
    assert torch.equal(whole.response_ids[4:6, :w], alone.response_ids) and texts[4:] == texts_alone
    assert torch.equal(whole.response_mask[4:6, :w], alone.response_mask)
    assert whole.group_index.tolist() == [0, 0, 1, 1, 2, 2] and alone.group_index.tolist() == [2, 2]
    other, _ = er.run(ex[2:], range(2, 3), 0, draw=6)
    assert not torch.equal(other.response_ids, alone.response_ids) or other.response_ids.shape != alone.response_ids.shape


def test_eval_of_an_env_run_plays_its_episodes(monkeypatch, tmp_path, capsys):
    """``echotrain eval --model RUN`` of a run trained with env=calculator evaluates as the run did:
    episodes with its environment, turns and budget (said in the first line); the same model
    evaluated by name gets single completions."""
    from echotrain.runtime import episodes as episodes_mod

    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "env=calculator", "max_turns=2", "steps=1",
               "save_every=0", "save_final_model=true", f"output_dir={run}") == 0
    capsys.readouterr()
    calls = []
    real = episodes_mod.run_episodes
    monkeypatch.setattr(episodes_mod, "run_episodes", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert cli(monkeypatch, "eval", "--model", str(run), "--prompts", "2", "--threads", "1", "--json") == 0
    captured = capsys.readouterr()
    assert "episodes with the run's environment (env=calculator, max_turns=2, max_episode_tokens=24)" in captured.err
    assert len(calls) == 1 and calls[0]["max_turns"] == 2 and calls[0]["max_episode_tokens"] == 24
    assert 0 <= json.loads(captured.out)["accuracy"] <= 1
    calls.clear()
    assert cli(monkeypatch, "eval", "--model", "testbed", "--task", "testbed-calc", "--prompts", "2", "--threads", "1",
               "--max-new-tokens", "4", "--json") == 0
    assert calls == [] and "episodes" not in capsys.readouterr().err


def test_eval_env_flags_play_episodes_with_any_model(monkeypatch, tmp_path, capsys):
    """``echotrain eval --env calculator`` plays episodes with a model given by name: the calculator testbed
    answers held-out sums with the tool (greedy, 16 problems: some right) and none without it (--env none, the
    documented start facts: 0 alone); a run's own env can be replaced by --env none, its max_turns by --max-turns."""
    args = ["--model", "testbed-calc", "--prompts", "16", "--n", "1", "--temperature", "0", "--max-new-tokens", "96",
            "--threads", "1", "--json"]
    assert cli(monkeypatch, "eval", *args, "--env", "calculator", "--max-turns", "2") == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("echotrain eval: episodes with testbed-calc's environment (env=calculator, "
                                   "max_turns=2, max_episode_tokens=384)")  # (its own: docs/evaluation.md)
    with_tool = json.loads(captured.out)
    assert cli(monkeypatch, "eval", *args, "--env", "none") == 0
    captured = capsys.readouterr()
    alone = json.loads(captured.out)
    assert "episodes" not in captured.err
    assert with_tool["accuracy"] >= 2 / 16 and alone["accuracy"] == 0.0
    run = tmp_path / "r"
    assert cli(monkeypatch, "train", *TINY, "task=testbed-calc", "env=calculator", "max_turns=2", "steps=1",
               "max_episode_tokens=30", "save_every=0", "save_final_model=true", f"output_dir={run}") == 0
    capsys.readouterr()
    base = ["eval", "--model", str(run), "--prompts", "2", "--threads", "1", "--json"]
    for flags, said in ((["--max-turns", "3"], "the run's environment (env=calculator, max_turns=3, max_episode_tokens=30)"),
                        (["--env", "calculator"], "the run's environment (env=calculator, max_turns=2, max_episode_tokens=30)"),
                        # another environment: its own max_turns (4) and the budget derived from the run's 6 tokens a turn
                        (["--env", "feedback"], "episodes with environment (env=feedback, max_turns=4, max_episode_tokens=48)")):
        assert cli(monkeypatch, *base, *flags) == 0
        assert said in capsys.readouterr().err, flags
    assert cli(monkeypatch, *base, "--env", "none") == 0
    assert "episodes" not in capsys.readouterr().err
    for flags in (["--env-option", "bogus=1"], ["--env", "calculator", "--env-option", "bogus=1"]):  # laid over the run's
        assert cli(monkeypatch, *base, *flags) == 2
        assert "the run's environment env='calculator' cannot be built here" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--env-option", "timeout_s=1"], "--env-option and --max-turns need an environment: --env NAME"),
    (["--max-turns", "2"], "--env-option and --max-turns need an environment"),
    (["--env", "calculator", "--max-turns", "0"], "--max-turns must be >= 1, got 0"),
    (["--env", "nope"], "--env 'nope' cannot be built here: "),
    (["--env", "calculator", "--env-option", "bogus=1"], "--env 'calculator' cannot be built here: "),
    (["--env", "calculator", "--env-option", "oops"], "--env-option 'oops' must be KEY=VALUE"),
    (["--env="], "--env must name an environment (or none: single completions)"),
    # testbed-calc's own environment (docs/evaluation.md), its options laid over
    (["--model", "testbed-calc", "--env-option", "bogus=1"],
     "--model 'testbed-calc': testbed-calc's environment env='calculator' cannot be built here: "),
    (["--model", "testbed-calc", "--max-turns", "0"], "--max-turns must be >= 1, got 0"),
])
def test_eval_env_flags_errors_exit_2_with_one_line(monkeypatch, capsys, flags, message):
    """(``--model testbed``: a policy without an environment of its own, unless the flags name another model)"""
    assert cli(monkeypatch, "eval", "--model", "testbed", "--prompts", "2", "--threads", "1", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _gemma_like_policy(folder):
    """A tiny Llama saved to ``folder`` with a Gemma-style template (no tool role) that ends every turn at once: the
    residual stream is the token's embedding, and only its dim 0 (1, or 10 for EOS) reaches the tied head."""
    from tests.runtime.test_episodes import GEMMA_LIKE
    from tests.train.conftest import make_model, make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = GEMMA_LIKE
    model = make_model(tok)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[tok.eos_token_id, 0] = 10.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_chat_template_without_a_tool_role_is_one_error_line(monkeypatch, tmp_path, capsys):
    """A chat model whose template refuses tool results (Gemma's rule) in an environment that replies with them:
    exit 2 and one error line naming chat_template=FILE at the first reply, no traceback; the same run with a
    template that has a tool role (chat_template=FILE) trains."""
    from tests.train.conftest import CHAT_TEMPLATE

    model_dir = _gemma_like_policy(tmp_path / "gemma-like")
    (tmp_path / "tool_env.py").write_text(
        "from echotrain.envs.base import EnvReply, register_env\n\n\n"
        "@register_env('always-tool')\nclass AlwaysTool:\n"
        "    def reset(self, example):\n        return list(example.messages)\n\n"
        "    def step(self, completion):\n        return EnvReply(messages=[{'role': 'tool', 'content': 'ok'}])\n")
    (tmp_path / "with_tool.jinja").write_text(CHAT_TEMPLATE)
    monkeypatch.chdir(tmp_path)
    args = ["train", f"model={model_dir}", "plugins=[./tool_env.py]", "env=always-tool", "max_turns=2",
            "prompts_per_step=2", "num_generations=2", "max_new_tokens=4", "max_episode_tokens=64", "micro_batch_size=4",
            "num_threads=1", "eval_prompts=0", "plots=false", "save_final_model=false", "progress=false", "steps=1",
            "save_every=0"]
    assert cli(monkeypatch, *args, f"output_dir={tmp_path / 'r'}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "echotrain train: error: the chat template cannot render the environment's reply (role 'tool') after a model "
        "turn: TemplateError: Conversation roles must alternate")
    assert cli(monkeypatch, *args, "chat_template=with_tool.jinja", f"output_dir={tmp_path / 'r2'}") == 0
    assert read_jsonl(tmp_path / "r2" / "metrics.jsonl")[0]["episode/env_tokens"] > 0
    # echotrain eval with that environment: the same line
    capsys.readouterr()
    assert cli(monkeypatch, "eval", "--model", str(model_dir), "--plugins", "./tool_env.py", "--env", "always-tool",
               "--max-turns", "2", "--prompts", "2", "--threads", "1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "echotrain eval: error: the chat template cannot render the environment's reply (role 'tool')")


@pytest.mark.parametrize("mode, first_tool", [([], 5), (["staleness=1"], 13), (["eval_prompts=2", "eval_every=1"], 13)],
                         ids=["on_policy", "staleness_1", "in_an_evaluation"])
def test_a_reply_the_template_refuses_later_keeps_the_completed_steps(monkeypatch, tmp_path, capsys, mode, first_tool):
    """An environment whose replies the template accepts at first (user) and refuses later (tool): exit 2 with one
    error line, and step 1 is checkpointed. An episode of max_turns 2 gets two replies, of which only the first is
    rendered (the second ends it): a training step's 4 episodes make replies 1-4 (rendered) and 5-8; so from the
    5th reply on the first refusal is in step 2's generation (the 9th; with staleness 1, steps 1 and 2 are generated
    at step 1 and the 17th is the first in step 3's, generated at step 2): nothing of step 2 is applied. With an
    evaluation at steps 0 and 1 (2 episodes, replies 1-4 and 13-16), from the 13th on the refusal is in the
    evaluation after step 1: step 1 is applied, logged and checkpointed."""
    model_dir = _gemma_like_policy(tmp_path / "gemma-like")
    name = f"late-tool-{len(mode)}"  # (a name per case: the registry is the process's)
    (tmp_path / "late_tool_env.py").write_text(
        "from echotrain.envs.base import EnvReply, register_env\n\nCALLS = [0]\n\n\n"
        f"@register_env('{name}')\nclass LateTool:\n"
        "    def reset(self, example):\n        return list(example.messages)\n\n"
        "    def step(self, completion):\n        CALLS[0] += 1\n"
        f"        return EnvReply(messages=[{{'role': 'tool' if CALLS[0] >= {first_tool} else 'user', 'content': 'ok'}}])\n")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "r"
    rc = cli(monkeypatch, "train", f"model={model_dir}", "plugins=[./late_tool_env.py]", f"env={name}", "max_turns=2",
             "prompts_per_step=2", "num_generations=2", "max_new_tokens=4", "max_episode_tokens=64",
             "micro_batch_size=4", "eval_prompts=0", "plots=false", "save_final_model=false", "progress=false",
             "steps=3", "save_every=0", "num_threads=1", *mode, f"output_dir={run}")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("echotrain train: error: the chat template cannot render the "
                                                   "environment's reply (role 'tool')")
    assert latest_checkpoint(run).name == "step_00000001.pt"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]

