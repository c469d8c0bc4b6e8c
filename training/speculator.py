"""Training a draft head (engine/spec_decode/eagle.py) from the target: `specserve speculator train`.

Must not change the engine: it sits above it (nothing in engine/ imports training/), drives a
plain engine through its public API and reads the target's layers the way the runner does
(engine/models/lean_forward.py).

1. Data (self-distillation, EAGLE's recipe): the target answers the prompts (a user's chat
   JSONL, or the default set of training/prompts.py: single and follow-up turns, tool turns)
   at high concurrency in our engine, greedy and sampled in turn (`--temperatures`), and
   `Recorder` keeps what its forwards compute: the captured layers' outputs at every
   position and the target's next-token distribution at
   every answer position (its top TOP_K, kept as soft labels). Raw text (`--text DIR`) adds
   teacher-forced windows of files (one forward each, logits at every row). Shards are saved
   as they are made, so a rerun resumes. `--from-traffic DIR` instead re-runs the answers the
   server recorded (`speculative.record`, engine/spec_decode/traffic.py) teacher-forced: the
   target's own answers to its users, with the features of one prefill each.
2. Training: the head starts as the target's last layer (`initialize_from_target`), or as a
   served head (`--resume`), and learns
   by training-time test (EAGLE-3): step 0 reads the target's features, step j its own output
   of step j - 1 with the true next token, each row attending to the true prefix's head K/V
   and its own chain's; loss: cross-entropy against the target's distribution (restricted to
   the draft vocabulary), step j weighted DECAY ** j; optionally EAGLE's feature regression.
   Checkpoints every few minutes; a rerun of the same command resumes.
3. Report: acceptance length per k on held-out conversations (greedy: drafts compared with the
   target's own top token), before and after training.
`--kind medusa` trains Medusa heads instead (engine/spec_decode/medusa.py) on the same data,
budget, checkpoints and report, from the target's last layer: their losses, acceptance and the
(head, rank) accuracies that choose their sparse tree are in training/medusa.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.spec_decode import medusa
from engine.spec_decode import heads as speculator_files
from engine.spec_decode.eagle import EagleHead, head_config, initialize_from_target, save_head
from training import medusa as medusa_training
from engine.spec_decode.speculator import NoSpeculation

log = logging.getLogger("specserve.train")

TOP_K = 16  # the target's most likely next tokens kept per position (soft labels)
DECAY = 0.8  # weight of training-time-test step j: DECAY ** j
TEXT_SUFFIXES = {".py", ".md", ".txt", ".rst", ".js", ".ts", ".go", ".rs", ".java", ".c",
                 ".cpp", ".h", ".sh", ".json", ".toml", ".yaml", ".yml", ".html", ".css"}


@dataclass
class TrainOptions:
    target: str  # recipe name, folder or hub id (as `engine.model`)
    out: str  # the head's folder (checkpoints and data under it)
    kind: str = "eagle"  # eagle (one EAGLE-3 head) | medusa (Medusa-1 heads)
    medusa_heads: int = 4  # medusa: heads (head j guesses the token j + 2 ahead)
    prompts: str | None = None  # chat JSONL ({"messages": [...]} or {"prompt": "..."})
    text: str | None = None  # a folder of raw text files for teacher forcing
    minutes: float = 60.0  # the whole budget: data, training, report
    data_share: float = 0.5  # of the budget, at most this much for generating answers
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = (0.0, 0.7)  # prompt i is answered at [i % len]
    concurrency: int = 16
    max_seq_len: int = 1024
    quantization: str = "auto"  # as `engine.quantization`: train on the target you serve
    dtype: str = "bfloat16"
    device: str = "auto"
    draft_vocab_size: int = 32768
    ttt_steps: int = 3  # training-time-test steps
    lr: float = 3e-4
    batch_tokens: int = 512  # trained tokens per optimizer step
    epochs: float | None = None  # stop after this many passes over the data (None: the budget)
    feature_loss: float = 0.0  # weight of EAGLE's feature regression (0: off)
    held_out: int = 8  # conversations kept for the report
    report_k: int = 5
    checkpoint_minutes: float = 3.0
    seed: int = 0
    from_traffic: str | None = None  # a folder of served traffic (speculative.record)
    resume: str | None = None  # a head's folder to fine-tune instead of a new head
    model_cache_dir: str | None = None
    progress: bool = True
    engine_overrides: dict = field(default_factory=dict)  # EngineConfig fields


@dataclass
class Example:
    ids: torch.Tensor  # [T] long
    features: torch.Tensor  # [T, F] the captured layers' outputs
    top_ids: torch.Tensor  # [T, TOP_K] the target's likeliest next tokens after position p
    top_probs: torch.Tensor  # [T, TOP_K] their probabilities
    mask: torch.Tensor  # [T] bool: position p's next token is trained on (answer tokens)


def _bar(total, desc: str, enabled: bool, unit: str = "it"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True,
                mininterval=1.0)


# -- data ---------------------------------------------------------------------------------------
def read_prompts(path: str | None) -> list[list[dict] | dict | str]:
    """Conversations from a chat JSONL file (`messages`, with `tools` where the conversation
    has tools; or `prompt` for raw text), or the default set."""
    if path is None:
        from training.prompts import default_prompts

        return default_prompts()
    out: list[list[dict] | str] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            value = row.get("messages") or row.get("prompt")
            if row.get("tools") and row.get("messages"):
                value = {"messages": row["messages"], "tools": row["tools"]}
        except (ValueError, AttributeError):
            value = None
        if value is None:
            raise ValueError(f"--prompts {path}:{n}: expected a JSON object with `messages` "
                             f"(a chat) or `prompt` (text)")
        out.append(value)
    if not out:
        raise ValueError(f"--prompts {path}: no prompts")
    return out


def encode(tokenizer, prompt: list[dict] | dict | str) -> list[int]:
    """A conversation's prompt token ids: rendered by the chat template (with its `tools`
    where it has them, as the server renders a request's), or raw text."""
    tools = prompt.get("tools") if isinstance(prompt, dict) else None
    messages = prompt["messages"] if isinstance(prompt, dict) else prompt
    if isinstance(messages, str) or getattr(tokenizer, "chat_template", None) is None:
        text = messages if isinstance(messages, str) else "\n".join(
            m.get("content") or "" for m in messages)
        return tokenizer.encode(text, add_special_tokens=False)
    return list(tokenizer.apply_chat_template(messages, tools=tools,
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def text_windows(folder: str, tokenizer, length: int) -> list[list[int]]:
    windows = []
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            ids = tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
            windows += [ids[i:i + length] for i in range(0, len(ids) - 16, length)]
    if not windows:
        raise ValueError(f"--text {folder}: no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return windows


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, layers: list[int], ids: list[int],
                   answer_from: int) -> Example:
    """One forward of `ids` through the target: features and next-token top-k at every
    position; positions from answer_from - 1 on predict answer tokens (trained on)."""
    first = max(answer_from - 1, 0)  # logits only where the next token is trained on
    t, logits, hidden = _forward(model, layers, ids, first)
    top_probs, top_ids = torch.softmax(logits[0].float(), dim=-1).topk(TOP_K, dim=-1)
    all_ids = torch.zeros((len(ids), TOP_K), dtype=torch.int32)
    all_probs = torch.zeros((len(ids), TOP_K), dtype=torch.float16)
    all_ids[first:], all_probs[first:] = top_ids.int().cpu(), top_probs.half().cpu()
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[first:len(ids) - 1] = True
    return Example(t[0].cpu(), hidden.to(torch.bfloat16).cpu(), all_ids, all_probs, mask)


@torch.inference_mode()
def refeature(model: torch.nn.Module, layers: list[int], example: Example) -> Example:
    """`example` with the features of `layers` (one forward of its token ids, as
    `teacher_forced` runs it); its answer, mask and the target's distributions are kept."""
    _, _, hidden = _forward(model, layers, example.ids.tolist(), len(example.ids))
    return replace(example, features=hidden.to(torch.bfloat16).cpu()[:len(example.features)])


def _forward(model: torch.nn.Module, layers: list[int], ids: list[int], first: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward of `ids` through the target: (ids on its device, logits at positions
    `first` on, the outputs of `layers` at every position)."""
    from engine.models import lean_forward

    device = next(model.parameters()).device
    t = torch.tensor([ids], device=device)
    logits, hidden = lean_forward.forward(model, t, torch.arange(len(ids), device=device)[None],
                                          torch.arange(first, len(ids), device=device),
                                          tuple(layers))
    return t, logits, hidden


class Recorder(NoSpeculation):
    """The engine's speculation hooks recording instead of speculating: per request, the
    captured layers' outputs at every position the target computes and its next-token top-k
    at every row it samples (the last prompt token, each decode step). The features are the
    serving path's own (the paged forward)."""

    def __init__(self) -> None:
        self.features: dict[str, dict[int, torch.Tensor]] = {}  # id -> first position -> rows
        self.labels: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def keep_features(self, entries, step) -> None:
        top_probs, top_ids = torch.softmax(step.logits.float(), dim=-1).topk(TOP_K, dim=-1)
        top_probs, top_ids = top_probs.half().cpu(), top_ids.int().cpu()
        hidden = step.hidden.to(torch.bfloat16).cpu()
        offset = 0
        for i, (seq, start, n) in enumerate(entries):
            rid = seq.request_id
            chunks = self.features.setdefault(rid, {})
            for first in [p for p in chunks if p >= start]:  # recomputed after a preemption
                del chunks[first]
            chunks[start] = hidden[offset:offset + n]
            rows = range(step.row_offsets[i], step.row_offsets[i + 1])
            labels = self.labels.setdefault(rid, {})
            for j, r in enumerate(rows):  # the item's last rows
                labels[start + n - len(rows) + j] = (top_ids[r], top_probs[r])
            offset += n

    def example(self, rid: str, ids: list[int], answer_from: int) -> Example:
        """The request's example (its token ids: prompt then answer), forgetting it."""
        chunks, labels = self.features.pop(rid), self.labels.pop(rid)
        features = torch.cat([chunks[p] for p in sorted(chunks)])[:len(ids) - 1]
        top_ids = torch.zeros((len(ids), TOP_K), dtype=torch.int32)
        top_probs = torch.zeros((len(ids), TOP_K), dtype=torch.float16)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for p, (a, b) in labels.items():
            if answer_from - 1 <= p < len(ids) - 1:
                top_ids[p], top_probs[p], mask[p] = a, b, True
        return Example(torch.tensor(ids), features, top_ids, top_probs, mask)


class Collector:
    """Shards of examples under out/data: the target's answers, recorded as it generates."""

    def __init__(self, opts: TrainOptions, engine, layers: list[int]) -> None:
        self.opts, self.engine, self.layers = opts, engine, list(layers)
        self.dir = Path(opts.out) / "data"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.recorder = Recorder()
        engine.runner.enable_capture(layers)
        engine.speculator = self.recorder

    def shards(self) -> list[tuple[Path, dict]]:
        return [(p, torch.load(p, weights_only=False))
                for p in sorted(self.dir.glob("shard-*.pt"))]

    def answered(self) -> dict[int, Example]:
        """The saved examples by their prompt's index (a shard of an older run holds the
        prompts from its `first` on, in order). A shard captured at other layers (a head of
        the other kind trained in this folder: EAGLE reads three layers, Medusa the last) keeps
        its answers and the target's distributions, and gets the features of these layers
        from one teacher-forced forward of each answer (`refeature`); the shard is saved so,
        for the next run of this kind."""
        out: dict[int, Example] = {}
        model = self.engine.runner.model
        width = len(self.layers) * model.config.get_text_config().hidden_size
        stale = 0
        for path, shard in self.shards():
            indices = shard.get("indices") or range(shard["first"],
                                                    shard["first"] + len(shard["examples"]))
            examples = shard["examples"]
            # (a shard of an older run does not name its layers: its features' width tells)
            if shard.get("layers", self.layers) != self.layers or any(
                    e.features.shape[-1] != width for e in examples):
                examples = [refeature(model, self.layers, e) for e in examples]
                stale += len(examples)
                partial = path.with_suffix(".partial")
                torch.save({**shard, "indices": list(indices), "layers": self.layers,
                            "examples": examples}, partial)
                partial.replace(path)  # (a run killed here leaves the old shard whole)
            out.update(zip(indices, examples))
        if stale:
            log.info("%d saved answers were captured at other layers: their features re-read "
                     "at layers %s", stale, self.layers)
        return out

    def collect(self, prompts: list[tuple[int, list[int]]], deadline: float, label: str) -> int:
        """Generate answers to `prompts` ((index, token ids) pairs) with `concurrency` requests
        in flight: a finished answer's place goes to the next prompt at once (a batch never
        waits for its longest answer), none is admitted after `deadline`; a shard per
        `concurrency` finished answers. Returns how many were answered."""
        from engine import SamplingParams

        opts, engine = self.opts, self.engine
        bar = _bar(len(prompts), f"answers ({label})", opts.progress, "prompt")
        queue, flight, done = list(prompts), {}, []  # flight: request id -> (index, ids)

        def save() -> None:
            torch.save({"first": min(i for i, _ in done), "indices": [i for i, _ in done],
                        "layers": self.layers, "examples": [e for _, e in done]},
                       self.dir / f"shard-{min(i for i, _ in done):06d}-{len(done):03d}.pt")
            done.clear()

        answered = 0
        while queue or flight:
            while queue and len(flight) < opts.concurrency and time.monotonic() < deadline:
                index, ids = queue.pop(0)
                params = SamplingParams(temperature=opts.temperatures[
                                            index % len(opts.temperatures)],
                                        seed=opts.seed + index,
                                        max_tokens=min(opts.max_new_tokens,
                                                       max(opts.max_seq_len - len(ids), 1)))
                flight[engine.add_request(ids, params)] = (index, ids)
            if not flight:
                break  # past the deadline
            for out in engine.step():
                if out.finished:
                    index, ids = flight.pop(out.request_id)
                    done.append((index, self.recorder.example(
                        out.request_id, ids + out.output_token_ids, len(ids))))
                    answered += 1
                    bar.update(1)
                    if len(done) >= opts.concurrency:
                        save()
        if done:
            save()
        bar.close()
        return answered


# -- training-time test -------------------------------------------------------------------------
def ttt_forward(head: EagleHead, embed: torch.nn.Module, ex: Example, steps: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step j: (h [n_j, H], logits [n_j, Vd]) of chain origins q = 0..n_j - 1 (n_j = T - j):
    step j's row of origin q sits at position q + j, reads the token there and the target's
    feature at q - 1 (step 0; a zero one for q = 0) or its own output of step j - 1, and
    predicts the next token (the target's distribution at position q + j)."""
    c = head.config
    device = next(head.parameters()).device
    dtype = head.fc.weight.dtype
    ids = ex.ids.to(device)
    n = len(ids)
    features = ex.features[:n - 1].to(device=device, dtype=dtype)
    g = head.fc(torch.cat([features.new_zeros((1, features.shape[1])), features]))
    with torch.no_grad():
        embedded = embed(ids)  # the target's embedding: not trained
    keys, values, out = [], [], []
    for j in range(steps):
        rows = n - j
        if rows <= 0:
            break
        g = g[:rows]
        q, k, v = head.qkv(embedded[j:j + rows].to(g.dtype), g,
                           torch.arange(j, j + rows, device=device))
        keys.append(k)
        values.append(v)
        # origin q attends to the true prefix's rows 0..q (step 0) and its own chain's row
        # of each later step
        kk = torch.cat([kk[:rows] if s else kk for s, kk in enumerate(keys)])
        vv = torch.cat([vv[:rows] if s else vv for s, vv in enumerate(values)])
        origin = torch.arange(rows, device=device)
        causal = torch.arange(n, device=device)[None, :] <= origin[:, None]
        diag = (origin[None, :] == origin[:, None]).repeat(1, j)
        mask = torch.cat([causal, diag], dim=1)
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=c.head_dim ** -0.5, enable_gqa=True)
        h = head.finish(g, att[0].transpose(0, 1))
        out.append((h, head.logits(h)))
        g = h
    return out


class Labels:
    """Target-id -> draft-row lookup, for soft labels over the draft vocabulary."""

    def __init__(self, vocab: torch.Tensor, target_vocab: int) -> None:
        self.row = torch.full((target_vocab,), -1, dtype=torch.long)
        self.row[vocab.cpu()] = torch.arange(len(vocab))
        self.vocab = vocab.cpu()

    def soft(self, ex: Example, positions: torch.Tensor, size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, draft vocab] target probabilities renormalized over the draft vocabulary,
        [rows] bool: rows with mass there) at `positions` ([rows] long)."""
        rows = self.row[ex.top_ids[positions].long()]
        probs = ex.top_probs[positions].float() * (rows >= 0)
        dense = torch.zeros((len(positions), size))
        dense.scatter_add_(1, rows.clamp(min=0), probs)
        total = dense.sum(1, keepdim=True)
        return dense / total.clamp(min=1e-9), total[:, 0] > 0.05


def step_losses(head: EagleHead, embed, ex: Example, labels: Labels, steps: int,
                feature_loss: float) -> tuple[torch.Tensor, list[float]]:
    """The example's training loss and each step's (Medusa: each head's) top-1 accuracy
    (trained rows)."""
    if isinstance(head, medusa.MedusaHeads):
        return medusa_training.losses(head, ex, labels)
    device = next(head.parameters()).device
    total, accuracy, weight = torch.zeros((), device=device), [], 0.0
    n = len(ex.ids)
    for j, (h, logits) in enumerate(ttt_forward(head, embed, ex, steps)):
        pos = torch.arange(j, j + len(h))  # where the target's distribution of its token is
        target, ok = labels.soft(ex, pos, logits.shape[1])
        ok &= ex.mask[pos]
        if not ok.any():
            continue
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(target.to(device) * logp).sum(1)
        ok_d = ok.to(device)
        total = total + DECAY ** j * ce[ok_d].mean()
        weight += DECAY ** j
        top = labels.row[ex.top_ids[pos, 0].long()].to(device)
        accuracy.append(float((logits.argmax(1) == top)[ok_d].float().mean()))
        if j == 0 and feature_loss > 0 and n > 2:
            # EAGLE's regression: row q's h should be what the next row's fused feature is
            with torch.no_grad():
                want = head.fc(ex.features[:n - 1].to(device=device,
                                                      dtype=head.fc.weight.dtype))
            rows = ok_d[:n - 1]
            total = total + feature_loss * F.smooth_l1_loss(h[:n - 1][rows].float(),
                                                            want[rows].float())
    return total / max(weight, 1e-9), accuracy


@torch.no_grad()
def acceptance_lengths(head: EagleHead, embed, examples: list[Example], labels: Labels,
                       k: int) -> list[float]:
    """Per k' = 1..k: the mean tokens one verification of k' greedy drafts emits (accepted
    + 1), over the answer positions of `examples` where greedy decoding would have emitted
    the recorded tokens (each draft compared with the target's top token, and the chain fed
    the recorded token only where it is that top token)."""
    if isinstance(head, medusa.MedusaHeads):
        return medusa_training.acceptance_lengths(head, examples, labels, k)
    sums, counts = [0.0] * k, [0] * k
    for ex in examples:
        outs = ttt_forward(head, embed, ex, k)
        rows = len(outs[-1][0]) if len(outs) == k else 0
        if rows <= 0:
            continue
        run = torch.ones(rows, dtype=torch.bool)
        valid = torch.ones(rows, dtype=torch.bool)
        accepted = torch.zeros(rows)
        for j, (_, logits) in enumerate(outs):
            pos = torch.arange(j, j + rows)
            top = ex.top_ids[pos, 0].long()
            greedy = ex.ids[pos + 1] == top if j + rows < len(ex.ids) else \
                torch.cat([ex.ids[pos[:-1] + 1] == top[:-1], torch.zeros(1, dtype=torch.bool)])
            run &= (logits[:rows].argmax(1).cpu() == labels.row[top]) & (labels.row[top] >= 0)
            valid &= ex.mask[pos]
            accepted += run.float()
            sums[j] += float(accepted[valid].sum())
            counts[j] += int(valid.sum())
            run &= greedy  # the next step's input is the recorded token: greedy's only here
    return [1.0 + s / max(c, 1) for s, c in zip(sums, counts)]


# -- the command --------------------------------------------------------------------------------
def _engine(opts: TrainOptions, model=None, tokenizer=None):
    from engine import EngineConfig, LLMEngine

    # no prefix cache (every position's features are recorded), no CUDA graphs (the runner
    # captures hidden states; it is switched on after start-up)
    cfg = dict(model=opts.target, dtype=opts.dtype, device=opts.device,
               quantization=opts.quantization, enable_prefix_caching=False, cuda_graphs="off",
               max_num_seqs=opts.concurrency, max_num_batched_tokens=1024,
               kv_cache_memory_gb=1.5, model_cache_dir=opts.model_cache_dir)
    cfg.update(opts.engine_overrides)
    return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)


def _draft_vocab(tokenizer, size: int, vocab_size: int) -> list[int]:
    from engine.models.draft import draft_vocabulary

    ids = draft_vocabulary(tokenizer, size, vocab_size) if tokenizer is not None else None
    return list(range(vocab_size)) if ids is None else ids.tolist()


def train(opts: TrainOptions, model=None, tokenizer=None) -> dict:
    """Build, train and save a head for `opts.target` within `opts.minutes`; returns the
    report (also written to out/report.json). `model`/`tokenizer`: given instead of loaded."""
    started = time.monotonic()
    deadline = started + 60.0 * opts.minutes
    random.seed(opts.seed)
    torch.manual_seed(opts.seed)
    engine = _engine(opts, model, tokenizer)
    target, tok = engine.runner.model, engine.tokenizer
    target.requires_grad_(False)  # only the head learns
    if tok is None:
        raise ValueError("training a speculator needs the target's tokenizer")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    head, config = _new_or_resumed(opts, target, tok, engine.vocab_size, device)
    data_deadline = started + 60.0 * opts.minutes * opts.data_share
    examples, held = (_traffic_examples(opts, target, config.layers, data_deadline)
                      if opts.from_traffic else
                      _answered_examples(opts, engine, tok, config.layers, data_deadline))
    data_seconds = time.monotonic() - started
    if len(examples) <= held:
        raise RuntimeError(f"only {len(examples)} conversations within the data budget: "
                           f"raise --minutes or lower --max-new-tokens")
    evaluation, training = examples[:held], examples[held:]
    if opts.text:
        windows = text_windows(opts.text, tok, opts.max_seq_len)
        training += [teacher_forced(target, config.layers, w, 1) for w in windows]
    if head is None:
        head = (medusa.MedusaHeads(config) if opts.kind == "medusa" else EagleHead(config))
        (medusa.initialize_from_target if opts.kind == "medusa"
         else initialize_from_target)(head, target)
        head = head.to(device)  # float32 master weights
    embed = target.get_input_embeddings()
    labels = Labels(head.vocab, engine.vocab_size)
    before = acceptance_lengths(head, embed, evaluation, labels, opts.report_k)
    trained = _fit(opts, head, embed, training, labels, deadline - _report_seconds(
        head, embed, evaluation, labels, opts.report_k), evaluation)
    after = acceptance_lengths(head, embed, evaluation, labels, opts.report_k)
    report = {"target": opts.target, "quantization": opts.quantization,
              "from_traffic": opts.from_traffic, "resumed_from": opts.resume,
              "conversations": len(examples), "held_out": held,
              "training_tokens": int(sum(len(e.ids) for e in training)),
              "answer_tokens": int(sum(int(e.mask.sum()) for e in training)),
              "data_seconds": data_seconds,
              "text_windows": len(training) - (len(examples) - held),
              "acceptance_length_untrained": before, "acceptance_length": after,
              "minutes": (time.monotonic() - started) / 60.0, **trained}
    head.config.trained = report
    if isinstance(head, medusa.MedusaHeads):  # its sparse tree, from held-out accuracies
        head.config.accuracy = medusa_training.rank_accuracy(head, evaluation, labels)
        head.config.tree = medusa.choose_tree(head.config.accuracy)
        report["rank_accuracy"] = head.config.accuracy
    save_head(head, str(out))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _new_or_resumed(opts: TrainOptions, target, tok, vocab_size: int, device):
    """(head, config) of a served head to fine-tune (`--resume`, of the kind asked for), or
    (None, a new head's config)."""
    if opts.kind not in ("eagle", "medusa"):
        raise ValueError(f"--kind {opts.kind!r}: use eagle or medusa")
    if opts.resume:  # a served head, fine-tuned (its own config: layers, vocabulary)
        head = speculator_files.load(opts.resume, opts.kind, target, torch.float32, device,
                                     "--resume")
        return head, head.config
    vocab = _draft_vocab(tok, opts.draft_vocab_size, vocab_size)
    if opts.kind == "medusa":
        if not 1 <= opts.medusa_heads <= 16:
            raise ValueError(f"--medusa-heads {opts.medusa_heads}: use 1..16")
        return None, medusa.medusa_config(target, opts.target, vocab, opts.medusa_heads)
    return None, head_config(target, opts.target, vocab)


def _answered_examples(opts: TrainOptions, engine, tok, layers: list[int],
                       data_deadline: float) -> tuple[list[Example], int]:
    """The target's answers to the prompts (a rerun's saved ones, then the missing ones until
    `data_deadline`), in prompt order, and how many of the first are held out."""
    prompts = [encode(tok, p) for p in read_prompts(opts.prompts)]
    prompts = [p[:opts.max_seq_len // 2] for p in prompts if p]
    held = min(opts.held_out, max(len(prompts) // 5, 1))
    collector = Collector(opts, engine, layers)
    answered = collector.answered()  # (a rerun's saved answers)
    missing = [(i, p) for i, p in enumerate(prompts) if i not in answered]
    if missing:
        # the held-out conversations first: the report needs them whatever the budget
        collector.collect(missing, max(data_deadline, time.monotonic() + 1.0)
                          if any(i < held for i, _ in missing) else data_deadline, "generating")
        answered = collector.answered()
    return [answered[i] for i in sorted(answered)], held


def _traffic_examples(opts: TrainOptions, target, layers: list[int], data_deadline: float
                      ) -> tuple[list[Example], int]:
    """The served answers recorded in `opts.from_traffic` (one folder: engine/spec_decode/
    traffic.py), re-run teacher-forced through the target for their features and the
    target's distributions (a prefill computes every position at once), oldest first, until
    `data_deadline` (the held-out ones whatever it); how many of the first are held out."""
    from engine.spec_decode.traffic import read_traffic

    rows = read_traffic(opts.from_traffic, target)
    held = min(opts.held_out, max(len(rows) // 5, 1))
    examples = []
    bar = _bar(len(rows), "teacher-forcing traffic", opts.progress, "request")
    for prompt, output in rows:
        if len(examples) >= held and time.monotonic() > data_deadline:
            break
        ids = (prompt + output)[:opts.max_seq_len]
        if len(prompt) < len(ids) - 1:  # at least two answer tokens left
            examples.append(teacher_forced(target, layers, ids, len(prompt)))
        bar.update(1)
    bar.close()
    return examples, held


def _report_seconds(head, embed, examples, labels, k) -> float:
    """What the final report will take: one timed evaluation of the untrained head."""
    t0 = time.monotonic()
    acceptance_lengths(head, embed, examples[:1], labels, k)
    return (time.monotonic() - t0) * len(examples) + 1.0


def _fit(opts: TrainOptions, head: EagleHead, embed, examples: list[Example], labels: Labels,
         deadline: float, evaluation: list[Example]) -> dict:
    """Train until `deadline` (monotonic), resuming from out/checkpoint; an optimizer step
    per `batch_tokens` trained tokens; at each checkpoint the held-out acceptance (the curve
    against training time)."""
    ckpt = Path(opts.out) / "checkpoint"
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    state = {"steps": 0, "epochs": 0, "at": 0, "seconds": 0.0, "tokens": 0, "history": [],
             "curve": []}
    if (ckpt / "state.json").exists():
        from safetensors.torch import load_file

        head.load_state_dict(load_file(str(ckpt / "model.safetensors")))
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=False))
        state = json.loads((ckpt / "state.json").read_text())
    device = next(head.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=device.type in ("cpu", "cuda"))
    def epoch_order(epoch: int) -> list[int]:  # the same on a resume
        order = list(range(len(examples)))
        random.Random(opts.seed * 1000 + epoch).shuffle(order)
        return order

    order = epoch_order(state["epochs"])
    last_save = t0 = time.monotonic()
    seconds0 = state["seconds"]
    bar = _bar(round(max(deadline - t0, 0.0)), "training", opts.progress, "s")
    recent: list[float] = []
    pending = 0  # trained tokens whose gradients wait for the next optimizer step
    head.train()
    optimizer.zero_grad(set_to_none=True)
    while time.monotonic() < deadline and (
            opts.epochs is None
            or state["epochs"] + state["at"] / max(len(order), 1) < opts.epochs):
        if state["at"] >= len(order):
            state["at"], state["epochs"] = 0, state["epochs"] + 1
            order = epoch_order(state["epochs"])
        ex = examples[order[state["at"]]]
        state["at"] += 1
        tokens = int(ex.mask.sum())
        with autocast:
            loss, accuracy = step_losses(head, embed, ex, labels, opts.ttt_steps,
                                         opts.feature_loss)
        if not loss.requires_grad or not math.isfinite(float(loss.detach())):
            continue
        (loss * tokens / opts.batch_tokens).backward()
        pending += tokens
        state["tokens"] += tokens
        recent = (recent + [accuracy[0] if accuracy else 0.0])[-50:]
        if pending >= opts.batch_tokens:
            _optimizer_step(optimizer, params, opts.lr, state)
            pending = 0
        now = time.monotonic()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}",
                        top1=f"{sum(recent) / len(recent):.2f}", steps=state["steps"],
                        refresh=False)
        bar.update(min(round(now - t0), bar.total) - bar.n)
        if now - last_save > 60.0 * opts.checkpoint_minutes and now < deadline:
            state["history"].append({"seconds": seconds0 + now - t0, "steps": state["steps"],
                                     "tokens": state["tokens"],
                                     "top1": sum(recent) / len(recent)})
            _measure(state, head, embed, evaluation, labels, opts, seconds0 + now - t0)
            head.train()
            state["seconds"] = seconds0 + now - t0
            _checkpoint(ckpt, head, optimizer, state)
            last_save = time.monotonic()
    if pending:  # the last, partial batch
        _optimizer_step(optimizer, params, opts.lr, state)
    bar.close()
    head.eval()
    state["seconds"] = seconds0 + time.monotonic() - t0
    _checkpoint(ckpt, head, optimizer, state)
    return {"train_steps": state["steps"], "train_epochs": state["epochs"],
            "train_seconds": state["seconds"], "trained_tokens": state["tokens"],
            "history": state["history"], "curve": state["curve"]}


def _optimizer_step(optimizer, params, lr: float, state: dict) -> None:
    for group in optimizer.param_groups:  # a short warm-up
        group["lr"] = lr * min(1.0, (state["steps"] + 1) / 10)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state["steps"] += 1


def _measure(state: dict, head: EagleHead, embed, evaluation: list[Example], labels: Labels,
             opts: TrainOptions, seconds: float) -> None:
    head.eval()
    lengths = acceptance_lengths(head, embed, evaluation, labels, opts.report_k)
    state["curve"].append({"train_seconds": seconds, "tokens": state["tokens"],
                           "acceptance_length": lengths})


def _checkpoint(folder: Path, head: EagleHead, optimizer, state: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(folder / "model.safetensors.tmp"))
    os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt.tmp")
    os.replace(folder / "optimizer.pt.tmp", folder / "optimizer.pt")
    (folder / "state.json.tmp").write_text(json.dumps(state))
    os.replace(folder / "state.json.tmp", folder / "state.json")


def format_report(report: dict) -> str:
    lines = [f"speculator for {report['target']} ({report['quantization']}): "
             f"{report['conversations']} conversations ({report['held_out']} held out), "
             f"{report['training_tokens']} training tokens, {report['train_steps']} steps in "
             f"{report['train_seconds'] / 60:.1f} min ({report['minutes']:.1f} min in all)",
             "acceptance length on held-out conversations (greedy, tokens per verification):",
             "  k     before  trained" if report.get("resumed_from") else
             "  k  untrained  trained"]
    for k, (a, b) in enumerate(zip(report["acceptance_length_untrained"],
                                   report["acceptance_length"]), 1):
        lines.append(f"  {k}  {a:9.2f}  {b:7.2f}")
    return "\n".join(lines)

