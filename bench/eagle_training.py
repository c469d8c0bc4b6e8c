"""A draft head's training on this machine: answer tokens per minute and held-out acceptance
length against training minutes, for the packaged 1.5B target as served (int4 on the CPU).

Trains the head with `specserve speculator train` (the prompts of training/prompts.py,
disjoint from bench/prompts) unless `--head` already holds a trained one, then writes the
curve from the head's report.json: acceptance length at k = 1..5 after each measured
checkpoint (greedy, tokens per verification of k drafts, teacher-forced on the held-out
answers), and the rate at which the target's answers were collected (answer tokens trained
on, held-out ones not counted, over the data share's seconds including the engine's start).
The baseline is the first head's run (Intel Xeon, 2026-12-01): 48 answer tokens/s, k=5 1.83.

    python bench/eagle_training.py --head DIR [--minutes 60] [--concurrency 32]

Prints the table, ends with `RESULT answer_tokens_per_min=… eagle_accept_len_k1=…
eagle_accept_len_k5=… train_minutes=…`, writes bench/results/eagle_training_<intel|amd>.md
(the CPU's maker: the first head's curve, the baseline, is eagle_training_intel.md).
`bench/spec_methods.py --speculator DIR` then serves the head (`make bench-eagle` runs both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from results_file import cpu_vendor, write_results

ROOT = Path(__file__).resolve().parents[1]

TARGET = "qwen2.5-coder-1.5b-instruct"
BASELINE = {"answer_tokens_per_min": 48.0 * 60, "k5": 1.83}  # 2026-12-01, Xeon


def train_command(args) -> list[str]:
    exe = str(Path(sys.executable).parent / "specserve")  # the environment's own
    return [exe, "speculator", "train", "--target", TARGET, "--out", args.head,
            "--minutes", f"{args.minutes:g}", "--concurrency", str(args.concurrency)]


def curve_table(report: dict) -> str:
    k = len(report["acceptance_length"])
    head = ("| training minutes | tokens trained | " + " | ".join(f"k={i}" for i in range(1, k + 1))
            + " |\n|" + "---|" * (k + 2))
    rows = [(0.0, 0, report["acceptance_length_untrained"], " (untrained)")]
    rows += [(p["train_seconds"] / 60, p["tokens"], p["acceptance_length"], "")
             for p in report.get("curve", [])]
    rows.append((report["train_seconds"] / 60, report["trained_tokens"],
                 report["acceptance_length"], " (final)"))
    return head + "".join(f"\n| {m:.1f}{tag} | {t} | " + " | ".join(f"{a:.2f}" for a in acc)
                          + " |" for m, t, acc, tag in rows)


def rate_per_min(report: dict) -> float:
    return report["answer_tokens"] / max(report["data_seconds"] / 60.0, 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True, help="the head's folder (trained if empty)")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / f"bench/results/eagle_training_{cpu_vendor()}.md"))
    args = parser.parse_args()
    command = train_command(args)
    ran = not (Path(args.head) / "config.json").exists()
    if ran and subprocess.run(command).returncode:
        return 2  # (the training printed why)
    report = json.loads((Path(args.head) / "report.json").read_text())
    table = curve_table(report)
    acc = report["acceptance_length"]
    rate = rate_per_min(report)
    result = (f"RESULT answer_tokens_per_min={rate:.0f} eagle_accept_len_k1={acc[0]:.2f} "
              f"eagle_accept_len_k5={acc[-1]:.2f} train_minutes={report['train_seconds'] / 60:.1f}")
    trained_by = " ".join(["specserve", *command[1:]])
    details = [
        f"head: `{trained_by}`" + ("" if ran else " (found trained in the folder: its report.json)"),
        f"target {report['target']} (--quantization {report['quantization']}); "
        f"{report['conversations']} conversations ({report['held_out']} held out), "
        f"{report['answer_tokens']} answer tokens trained on, {report['training_tokens']} "
        f"tokens in all, {report['train_steps']} optimizer steps",
        f"answers collected in {report['data_seconds'] / 60:.1f} min: {rate:.0f} answer tokens "
        f"per minute ({rate / 60:.1f}/s; baseline 2026-12-01 {BASELINE['answer_tokens_per_min']:.0f}"
        f"/min: {rate / BASELINE['answer_tokens_per_min']:.2f}x); training "
        f"{report['train_seconds'] / 60:.1f} min; {report['minutes']:.1f} min in all",
        f"held-out acceptance length at k=5: {acc[-1]:.2f} (baseline {BASELINE['k5']:.2f})",
    ]
    print(table)
    print(result)
    write_results(args.out, "Draft head training: acceptance against training time",
                  torch.get_num_threads(), details, table, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
