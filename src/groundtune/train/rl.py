"""Reinforcement learning for grounding, the boxes' IoU as reward (``groundtune rl``).

    groundtune rl quickstart-rl model=quickstart/run        # from an SFT run (its LoRA adapter trains on)
    groundtune rl CONFIG.yaml model=runs/sft train_data=train.jsonl eval_data=val.jsonl
    groundtune rl --resume runs/rl                          # exact: weights, optimizer, RNG, prompts, baselines
    torchrun --nproc-per-node N -m groundtune rl CONFIG.yaml ...   # each rank its prompts (docs/scaling.md)

One step, as the code below reads:
  1. rollouts: ``batch_size`` prompts, ``group_size`` sampled answers each, through the one
     generation path (``infer.generate``: same resize, prompt and box parser as eval; the run's
     generation engine prefills each prompt once for its group), with every decoding setting
     given (``temperature``, ``top_p``, ``top_k`` off unless set): none comes from the checkpoint,
     whose top_k=1 (Qwen2.5-VL) would make every answer of a group the same;
  2. rewards: ``rewards.reward`` of each answer: its boxes matched one to one with the true set,
     their summed IoU over the larger side (one box against one: its IoU), plus a format term;
     ``[]`` to a phrase that names nothing earns the full box term, an answer that could not be
     read earns 0 (the logs' ``rollout/parse_fail_rate`` counts those, never a ``[]``);
  3. advantages: GRPO's group normalisation, (r - mean) / std over a prompt's answers, or REINFORCE
     with a moving-average baseline per prompt (``advantage=ema``, the seed design's variant);
  4. update: ``inner_updates`` gradient steps on the clipped policy-ratio objective, plus
     ``kl_coef`` x KL to the starting policy; the answers to one prompt share it (one row,
     ``qwen.collate_answers``: the prompt and its image run once for its G answers).
With ``curriculum=true`` (the seed design's), step 1 draws only prompts that can still teach: one
whose last group was solved (every answer at IoU >= 0.5) or hopeless (none) sits out its next turn
in the prompt order, and is back on the turn after, when the policy may have changed.

On several ranks (torchrun): every rank draws the same global list of ``batch_size`` x ranks
prompts and samples the groups of its own share (a group never spans ranks); the rewards of
all groups are shared, so advantages, baselines, the curriculum and the logs are the same on every
rank; the update's loss is divided by the answer tokens of all ranks' groups, as one process would.

Where it departs from GRPO (Shao et al., 2024): the loss is the mean over every answer token of
the batch (DAPO's token-level mean), not a mean per answer first, so a long answer weighs by its
tokens; the KL term (Schulman's k3 estimator) is off by default (``kl_coef=0``), as in DAPO; a
group whose answers all earn the same reward teaches nothing and gets zero advantage. The
reference policy for the KL term is the starting model computed on the same weights, never a
second copy: a new LoRA switched off, or, from an SFT run, a frozen copy of its adapter alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from groundtune import infer
from groundtune.config import RLConfig
from groundtune.data.records import sample_boxes
from groundtune.data.samples import FileSamples, ResumableBatches
from groundtune.errors import ConfigError, DataError
from groundtune.models import adapt, attention, head, qwen, speedups
from groundtune.models.adapt import base_model
from groundtune.models.loading import GroundingModel, load_model, pick_device, resolve
from groundtune.progress import progress_bar
from groundtune.runs import RunFolder
from groundtune.train import distributed
from groundtune.train.batches import to_device
from groundtune.train.loop import Loop, RunData, run_stage, seed_everything, use_bf16
from groundtune.train.monitor import StopRequest, gpu_stats
from groundtune.train.parallel import Parallel
from groundtune.train.rewards import RewardWeights, reward

REFERENCE = "reference"  # the frozen copy of an SFT run's adapter, for the KL term
SHARED_ANSWER_ROWS = True  # bench/rl_speed.py switches it off to time the update with padded rows


@dataclass
class Rollouts:
    """One step's answers, prompt by prompt, ``group_size`` answers each."""

    sequences: list[dict]  # encoded prompt + answer ids, labelled on the answer (qwen.with_answer_ids)
    rewards: torch.Tensor  # (prompts, group_size)
    ious: torch.Tensor  # (prompts, group_size) plain IoU, for the logs
    parsed: torch.Tensor  # (prompts, group_size) bool: the answer was read (boxes, or [] for "none")
    lengths: torch.Tensor  # (prompts, group_size) answer tokens
    prompt_keys: list[int]  # sample index of each prompt (the EMA baseline's key)


def rl(cfg: RLConfig | None = None, resume: str | Path | None = None, on_step=None,
       resume_overrides: tuple[str, ...] = ()) -> Path:
    """Run RL and return the run folder. ``on_step(step, run, model)`` is called after every update."""
    return run_stage(RLConfig, cfg, resume, resume_overrides, _rl, on_step)


def _rl(run: Path, cfg: RLConfig, resume_from: Path | None, data: RunData, on_step,
        ranks: distributed.Ranks = distributed.Ranks()) -> Path:
    seed_everything(cfg.seed)  # the same on every rank: the same initial weights
    gm, model, reference = _setup_policy(cfg, distributed.device_for(ranks, cfg.device))
    device = gm.device
    samples = data.samples
    trainable = adapt.count_parameters(model)["trainable"]  # (counted before an engine shards them)
    parallel = Parallel(model, ranks, cfg.distributed, torch.bfloat16 if use_bf16(cfg, device) else None)
    loop = Loop.start(run, cfg, gm, resume_from, data, on_step, parallel, baselines={}, sitting_out=[])
    optimizer, scheduler, state = loop.optimizer, loop.scheduler, loop.state
    if resume_from is None and ranks.rank > 0:
        torch.manual_seed(cfg.seed + ranks.rank)  # each rank samples its own answers (a resume restores each's)
    decoding = rollout_decoding(cfg)
    # kept for the run: on a GPU its captured decode steps are reused; not over sharded weights,
    # which are gathered anew (at new addresses) for every batch of rollouts
    engine = infer.engine_for(gm, graphs=not parallel.sharded)
    if resume_from is None:
        loop.log.log(0, {"rollout/decoding": decoding.to_dict()})
    order = ResumableBatches(len(samples), cfg.batch_size, cfg.seed, state["samples"], samples.shuffle)
    prompts = (item for batch in order for item in batch)  # (sample index, position in the order)
    # a synthetic stream never repeats a prompt: no baseline per prompt to keep
    baselines = state["baselines"] if isinstance(samples, FileSamples) else None
    autocast = loop.autocast()
    weights = RewardWeights(box=cfg.reward_box, format=cfg.reward_format, giou=cfg.reward_giou,
                            missed=cfg.reward_missed)
    if ranks.main:
        on = f" on each of {ranks.world} ranks" if ranks.many else ""
        print(f"rl on {gm.source} ({trainable:,} trainable parameters): "
              f"{cfg.batch_size} prompts x {cfg.group_size} answers per step{on} from {cfg.train_data} -> {run}")
    if loop.eval_samples and state["step"] == 0:
        loop.evaluate()  # where RL starts from

    with StopRequest(run) as stop, progress_bar() as bar:
        task = bar.add_task("rl", total=cfg.max_steps, completed=state["step"], info="")
        say = functools.partial(bar.console.print, soft_wrap=True)
        while state["step"] < cfg.max_steps:
            t0 = time.time()
            # every rank draws the same global list (the same order and curriculum), then takes its share
            keys, drawn = next_prompts(prompts, cfg.batch_size * ranks.world,
                                       state["sitting_out"] if cfg.curriculum else None)
            pairs, mine, failed = load_prompts(samples, keys[ranks.rank * cfg.batch_size :][: cfg.batch_size])
            if failed:
                loop.skip_unreadable(failed, len(failed) + len(mine))
            # as many groups on every rank (the engines' collectives pair the ranks' micro-batches)
            kept = min(distributed.everyone(len(mine), ranks))
            with parallel.gathered():  # sharded weights gathered once for all the rollouts
                batch = rollouts(gm, pairs[:kept], mine[:kept], cfg.group_size, decoding, weights, engine)
            t1 = time.time()
            everyone = shared_rollouts(batch, ranks)  # every rank's groups: the same on every rank
            adv = advantages(everyone.rewards, everyone.prompt_keys, cfg, baselines)
            mine_adv = adv[ranks.rank * kept :][:kept]
            with adapt.lora_inputs_uncast(model):  # the update's forward and backward (adapt.py says why)
                stats = update(parallel, reference, batch, mine_adv, optimizer, cfg, autocast,
                               gm.processor.pad_token_id, int(everyone.lengths.sum()))
            t2 = time.time()
            state["samples"] += drawn
            if cfg.curriculum:
                mark_finished_groups(state["sitting_out"], everyone.prompt_keys, everyone.ious)
            if not stats["finite"]:
                loop.skip_nonfinite({}, "lower lr or temperature")
                continue
            lr = scheduler.get_last_lr()[0]  # what this update used (the scheduler then moves on)
            scheduler.step()
            step = state["step"] + 1
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                values = {**_rollout_metrics(everyone, t1 - t0), "loss": stats["loss"], "kl": stats["kl"],
                          "clip_fraction": stats["clip_fraction"], "grad_norm": stats["grad_norm"],
                          "lr": lr, "time/rollout_s": t1 - t0, "time/update_s": t2 - t1,
                          "samples": state["samples"], **gpu_stats(device)}
                if cfg.curriculum:
                    values["curriculum/sat_out"] = drawn - len(keys)  # this step's prompts that sat out
                loop.log.log(step, values)
                bar.update(task, info=f"reward {values['reward/mean']:.3f} Acc@0.5 {values['rollout/acc@0.5']:.2f} "
                                      f"{values['rollouts_per_s']:.1f} rollouts/s")
            bar.update(task, completed=step)
            if loop.after_update(stop, say):
                break
    return loop.finish()


# --------------------------------------------------------------------------------------------
# the four parts of a step, and the curriculum that picks the prompts


def next_prompts(order, n: int, sitting_out: list[int] | None) -> tuple[list[int], int]:
    """The next ``n`` prompts (sample indices) of the run's order, and how many of the order were
    used up. With the curriculum (``sitting_out`` not None), a prompt listed there sits this turn
    out and is taken off the list, so it is back on its next turn; the list is the run's state,
    saved with its checkpoints."""
    keys, drawn = [], 0
    while len(keys) < n:
        index, _ = next(order)
        drawn += 1
        if sitting_out is not None and index in sitting_out:
            sitting_out.remove(index)
        else:
            keys.append(index)
    return keys, drawn


def load_prompts(samples, keys: list[int]) -> tuple[list[tuple], list[int], list[str]]:
    """(image, record) of each prompt, the keys of those that loaded, and why the others did not
    (a file deleted or damaged since the run's check: left out of this step, counted by the loop)."""
    pairs, kept, failed = [], [], []
    for key in keys:
        try:
            pairs.append(samples[key])
            kept.append(key)
        except DataError as e:
            failed.append(str(e))
    return pairs, kept, failed


def mark_finished_groups(sitting_out: list[int], keys: list[int], ious: torch.Tensor) -> None:
    """List the prompts whose group was solved (every answer at IoU >= 0.5) or hopeless (none):
    a solved prompt has little left to teach, a hopeless one rarely samples a hit, so their next
    turn goes to prompts the policy is still deciding on."""
    hits = ious >= 0.5
    for key, finished in zip(keys, (hits.all(dim=1) | ~hits.any(dim=1)).tolist()):
        if finished and key not in sitting_out:
            sitting_out.append(key)


def rollout_decoding(cfg: RLConfig) -> infer.Decoding:
    """How rollouts are sampled: the config's temperature, top_p and top_k, and nothing else (no
    repetition penalty: a box may repeat a digit)."""
    return infer.Decoding.sampled(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)


def rollouts(gm: GroundingModel, pairs: list[tuple], keys: list[int], group_size: int, decoding: infer.Decoding,
             weights: RewardWeights, engine=None) -> Rollouts:
    """Sample ``group_size`` answers with ``gm.model`` for each (image, sample) pair and score them.
    ``engine`` (``infer.engine_for``, kept for the run) prefills each prompt once for its group."""
    encoded, sizes = infer.encode_prompts(gm, [(image, sample["phrase"]) for image, sample in pairs])
    answers = infer.generate(gm, encoded, sizes, decoding, group_size, engine=engine)
    scores, sequences, reads = [], [], []
    for k, (ids, prediction) in enumerate(answers):
        image, sample = pairs[k // group_size]
        reads.append(answer_boxes(prediction))
        scores.append(reward(reads[-1], sample_boxes(sample), image.size, weights))
        sequences.append(qwen.with_answer_ids(gm.processor, encoded[k // group_size], ids))
    shape = (len(pairs), group_size)
    return Rollouts(
        sequences=sequences,
        rewards=torch.tensor([s["reward"] for s in scores]).view(shape),
        ious=torch.tensor([s["iou"] for s in scores]).view(shape),
        parsed=torch.tensor([read is not None for read in reads], dtype=torch.bool).view(shape),
        lengths=torch.tensor([len(ids) for ids, _ in answers]).view(shape),
        prompt_keys=keys,
    )


def answer_boxes(prediction: infer.Prediction) -> list[list[float]] | None:
    """An answer as the reward reads it: its boxes; ``[]`` when it said nothing matches (a read
    answer, right on a no-target phrase); None when it could not be read (a parse failure)."""
    return prediction.boxes if prediction.boxes or prediction.no_target else None


def shared_rollouts(batch: Rollouts, ranks: distributed.Ranks) -> Rollouts:
    """The scores of every rank's rollouts, in rank order, on every rank (their sequences stay
    where they were sampled): what advantages, baselines, the curriculum and the logs read."""
    if not ranks.many:
        return batch
    parts = distributed.everyone((batch.rewards, batch.ious, batch.parsed, batch.lengths, batch.prompt_keys), ranks)
    rewards, ious, parsed, lengths, keys = zip(*parts)
    return Rollouts(sequences=[], rewards=torch.cat(rewards), ious=torch.cat(ious), parsed=torch.cat(parsed),
                    lengths=torch.cat(lengths), prompt_keys=[k for part in keys for k in part])


def advantages(rewards: torch.Tensor, prompt_keys: list[int], cfg: RLConfig,
               baselines: dict[str, float] | None) -> torch.Tensor:
    """(prompts, group_size) rewards -> advantages of the same shape.

    grpo: (r - group mean) / group std; a group of equal rewards gets 0.
    ema:  r - b, b a moving average of the prompt's past mean rewards (updated here, in
          ``baselines``); a prompt seen for the first time, or any prompt when ``baselines`` is
          None (a stream that never repeats one), is measured against its group's mean."""
    mean = rewards.mean(dim=1, keepdim=True)
    if cfg.advantage == "grpo":
        std = rewards.std(dim=1, keepdim=True)
        return torch.where(std > 1e-6, (rewards - mean) / (std + 1e-4), torch.zeros_like(rewards))
    if baselines is None:
        return rewards - mean
    out = torch.empty_like(rewards)
    for row, key in enumerate(map(str, prompt_keys)):  # str: the baselines are saved as JSON
        group_mean = float(mean[row])
        baseline = baselines.get(key, group_mean)
        out[row] = rewards[row] - baseline
        baselines[key] = cfg.ema_decay * baseline + (1 - cfg.ema_decay) * group_mean
    return out


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, token_advantages: torch.Tensor,
                clip: float, kl_coef: float = 0.0, ref_logprobs: torch.Tensor | None = None):
    """Per-token clipped policy-ratio loss (PPO/GRPO) plus ``kl_coef`` x the k3 estimate of
    KL(policy || reference). Returns (per-token loss, per-token KL, per-token clipped flag)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1 - clip, 1 + clip)
    loss = -torch.minimum(ratio * token_advantages, clipped_ratio * token_advantages)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # >= 0, unbiased (Schulman, "Approximating KL divergence")
        loss = loss + kl_coef * kl
    return loss, kl, ratio != clipped_ratio


def update(parallel: Parallel, reference, batch: Rollouts, adv: torch.Tensor, optimizer, cfg: RLConfig, autocast,
           pad_token_id: int, total_tokens: int | None = None) -> dict:
    """``inner_updates`` optimizer steps on the answers, ``micro_batch`` answers per forward pass;
    the loss is the token-level mean over the whole batch (``total_tokens``: the answer tokens of
    every rank's batch; by default this one's), whatever the micro-batching. ``parallel``: the
    policy as the ranks train it (``Parallel``)."""
    model, objective = parallel.model, parallel.objective
    device = next(p for p in model.parameters() if p.requires_grad).device
    chunks = [list(range(i, min(i + cfg.micro_batch, len(batch.sequences))))
              for i in range(0, len(batch.sequences), cfg.micro_batch)]
    group_size = batch.rewards.shape[1]
    # The answers to one prompt share it: in one row (qwen.collate_answers) the prompt, its image
    # included, goes through the model once for all of them. Without groundtune's attention (a
    # model on transformers' flash-attention) they are padded rows that share the vision pass only:
    # the first answer of a prompt in a chunk lends its image to the rest.
    one_row = SHARED_ANSWER_ROWS and attention.shares_prefixes(base_model(model))
    prompt_of = [[r // group_size for r in rows] for rows in chunks]
    image_of_row = [None if one_row else [prompts.index(p) for p in prompts] for prompts in prompt_of]
    per_answer_adv = adv.flatten()
    total_tokens = total_tokens or int(batch.lengths.sum())
    old, ref = {}, {}
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "finite": True}
    for inner in range(cfg.inner_updates):
        loss_sum = kl_sum = clipped = 0.0
        for c, rows in enumerate(chunks):
            answers = [batch.sequences[r] for r in rows]
            micro = to_device(qwen.collate_answers(answers) if one_row else qwen.collate(answers, pad_token_id), device)
            if inner == 0 and cfg.kl_coef > 0:
                with torch.no_grad(), autocast, reference():
                    ref[c] = objective(micro, image_of_row[c])[0].float()
            with parallel.accumulating(last=c == len(chunks) - 1):  # the ranks' gradients meet on the last
                with autocast:
                    logprobs, owner = objective(micro, image_of_row[c])
                if inner == 0:  # the policy has not moved yet: its log-probs are the old ones
                    old[c] = logprobs.detach()
                token_adv = per_answer_adv[torch.tensor(rows)][owner.cpu()].to(device)
                loss, kl, was_clipped = policy_loss(logprobs, old[c], token_adv, cfg.clip, cfg.kl_coef, ref.get(c))
                loss = loss.sum() / total_tokens
                # one rank's non-finite loss stops the update everywhere, decided before any backward
                if distributed.any_rank(not bool(torch.isfinite(loss)), parallel.ranks, device):
                    stats["finite"] = False
                    break
                parallel.backward(loss)
            loss_sum += float(loss.detach())
            kl_sum += float(kl.detach().sum())
            clipped += float(was_clipped.sum())
        if not stats["finite"]:
            parallel.drop_gradients(optimizer)
            return stats
        grad_norm = parallel.step(optimizer, cfg.max_grad_norm)
        if grad_norm is None:  # not finite: nothing applied
            stats["finite"] = False
            return stats
        ranks = parallel.ranks
        stats.update(loss=distributed.total(loss_sum, ranks, device), grad_norm=grad_norm,
                     kl=distributed.total(kl_sum, ranks, device) / total_tokens,
                     clip_fraction=distributed.total(clipped, ranks, device) / total_tokens)
    return stats


# --------------------------------------------------------------------------------------------
# setup and logs


def _setup_policy(cfg: RLConfig, device_setting: str | None = None):
    """The model to train (on ``device_setting``, by default cfg.device; under torchrun, the rank's
    GPU) and a context manager under which it computes the reference policy.

    From an SFT run with a LoRA adapter, that adapter trains on, and the reference is a frozen copy
    of it (adapter-sized, not a second model). From anything else, a new LoRA goes on the model
    (initialised to change nothing) and the reference is the model with that adapter switched off."""
    device_setting = device_setting or cfg.device
    device = pick_device(device_setting)
    gm = load_model(cfg.model, device=device_setting, dtype="bf16" if use_bf16(cfg, device) else "fp32")
    if head.head_of(gm.model) is not None:
        raise ConfigError(f"model={cfg.model} answers with a box head (head: box): RL samples answers and scores "
                          "them, and a box head has none to sample; start RL from a run with head=text")
    if hasattr(gm.model, "peft_config"):  # an SFT run's adapter: train it further
        model = gm.model
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
        reference = contextlib.nullcontext
        if cfg.kl_coef > 0:
            kind, path = resolve(cfg.model)
            model.load_adapter(RunFolder(path).model if kind == "run" else path, adapter_name=REFERENCE)
            reference = functools.partial(_active_adapter, model, REFERENCE)
    else:
        model = adapt.add_lora(gm.model, cfg)
        reference = model.disable_adapter
    if cfg.gradient_checkpointing:
        adapt.checkpoint_last_layers(model, cfg.gradient_checkpointing)
    adapt.keep_trainable_fp32(model)
    speedups.install(model, cfg.kernels, say=print)
    model.train()
    return dataclasses.replace(gm, model=model), model, reference


@contextlib.contextmanager
def _active_adapter(model, name: str):
    """Run the model with another of its adapters; the trained one ("default") comes back
    trainable (PEFT's set_adapter marks the active adapter's weights trainable, the others not)."""
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter("default")


def _rollout_metrics(batch: Rollouts, rollout_s: float) -> dict:
    """One step's rollouts in the log. ``rollout/iou`` and ``rollout/acc@0.5`` read the plain-IoU
    box term (a set's matched IoU; 1 for ``[]`` to a no-target phrase); ``rollout/parse_fail_rate``
    is the share of answers that could not be read: a ``[]`` answer said "none" and is not one."""
    n = batch.rewards.numel()
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if n > 1 else 0.0,
        "rollout/iou": float(batch.ious.mean()),
        "rollout/acc@0.5": float((batch.ious >= 0.5).float().mean()),
        "rollout/parse_fail_rate": float(1 - batch.parsed.float().mean()),
        "rollout/answer_tokens": float(batch.lengths.float().mean()),
        "rollout/solved_groups": float((batch.ious >= 0.5).all(dim=1).float().mean()),
        "rollout/hopeless_groups": float((batch.ious < 0.5).all(dim=1).float().mean()),
        "rollout/iou_histogram": torch.histc(batch.ious.float(), bins=10, min=0, max=1).int().tolist(),
        "rollouts_per_s": n / max(rollout_s, 1e-9),
    }

