"""Learning from served traffic, end to end: serve the default with `speculative.record` on,
send chat requests, fine-tune the served head on what was recorded, and compare the head's
held-out acceptance length before and after.

1. `specserve serve --config configs/default.yaml` with `record: {dir: WORK/traffic}` added.
2. The held-out requests first (a quarter of the prompts of bench/prompts/chat.jsonl and
   code_edit.jsonl, never sent again: answered greedily and at temperature 0.7), one at a
   time, so they are the oldest rows of the traffic and the ones `--from-traffic` holds out;
   then `--requests` requests over the other prompts at temperature 0.7, each with its own
   seed, `--concurrency` at a time, through the official `openai` client.
3. `specserve speculator train --from-traffic WORK/traffic/shared --resume HEAD --minutes M`:
   the recorded answers re-run teacher-forced, the head fine-tuned; its report holds the
   held-out acceptance length of the head before (as served) and after.

    python bench/traffic_finetune.py --head DIR [--requests 200] [--minutes 10]

Prints the table, ends with `RESULT traffic_accept_len_k5_before=… traffic_accept_len_k5_after=…
traffic_requests=…`, writes bench/results/traffic_finetune.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from results_file import write_results  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

TARGET = "qwen2.5-coder-1.5b-instruct"
# `--from-traffic` holds out its oldest min(8, rows // 5) rows: the 8 held-out requests
HELD_REQUESTS = 8


def prompts() -> tuple[list[list[dict]], list[list[dict]]]:
    """(held-out, trained) message lists: every fourth prompt of each file is held out."""
    held, trained = [], []
    for name in ("chat.jsonl", "code_edit.jsonl"):
        rows = [json.loads(line) for line in (ROOT / "bench/prompts" / name).read_text()
                .splitlines() if line.strip()]
        for i, row in enumerate(rows):
            (held if i % 4 == 3 else trained).append(row["messages"])
    return held, trained


def serve_config(work: Path) -> Path:
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config["engine"]["speculative"]["record"] = {"dir": str(work / "traffic"), "max_gb": 1}
    path = work / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def send(client, model: str, messages: list[dict], temperature: float, seed: int,
         max_tokens: int) -> int:
    answer = client.chat.completions.create(model=model, messages=messages, seed=seed,
                                            temperature=temperature, max_tokens=max_tokens)
    return answer.usage.completion_tokens


def record_traffic(args, work: Path) -> dict:
    import openai

    held, trained = prompts()
    srv = ServerProcess(["--config", str(serve_config(work)), "--num-threads",
                         str(args.threads)]).wait_ready(timeout=900)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id
        t0 = time.monotonic()
        held_tokens = sum(send(client, model, m, t, 1000 + i, args.max_tokens)
                          for i, (m, t) in enumerate((m, t) for m in held for t in (0.0, 0.7)))
        rng = random.Random(0)
        jobs = [(rng.choice(trained), 2000 + i) for i in range(args.requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(lambda job: send(client, model, job[0], 0.7, job[1],
                                                   args.max_tokens), jobs))
        seconds = time.monotonic() - t0
    finally:
        srv.terminate()
    return {"held_requests": 2 * len(held), "held_tokens": held_tokens,
            "requests": args.requests, "tokens": tokens, "seconds": seconds,
            "held_prompts": len(held), "trained_prompts": len(trained)}


def traffic_folder(work: Path) -> Path:
    folders = [p for p in (work / "traffic").iterdir() if p.is_dir()]
    if len(folders) != 1:
        raise RuntimeError(f"expected one traffic folder under {work / 'traffic'}, found "
                           f"{[p.name for p in folders]}")
    return folders[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", required=True, help="the served head (make bench-eagle's)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=10.0, help="of training")
    parser.add_argument("--data-minutes", type=float, default=6.0,
                        help="at most so long re-running the traffic teacher-forced")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=None, help="where traffic and the new head go")
    parser.add_argument("--out", default=str(ROOT / "bench/results/traffic_finetune.md"))
    args = parser.parse_args()
    if (args.requests + HELD_REQUESTS) // 5 < HELD_REQUESTS:
        parser.error(f"--requests {args.requests}: at least {4 * HELD_REQUESTS}, so that "
                     f"training holds out exactly the {HELD_REQUESTS} held-out requests")
    if not (Path(args.head) / "config.json").exists():
        parser.error(f"--head {args.head}: no trained head there (make bench-eagle trains one)")
    work = Path(args.work or tempfile.mkdtemp(prefix="specserve-traffic-"))
    work.mkdir(parents=True, exist_ok=True)
    sent_file = work / "sent.json"
    if not sent_file.exists():  # a rerun with the same --work trains on what was recorded
        sent_file.write_text(json.dumps(record_traffic(args, work)))
    sent = json.loads(sent_file.read_text())
    folder = traffic_folder(work)
    exe = str(Path(sys.executable).parent / "specserve")  # the environment's own
    # the budget: --minutes of training after at most --data-minutes of teacher forcing
    budget = args.minutes + args.data_minutes
    command = [exe, "speculator", "train", "--target", TARGET, "--out", str(work / "head"),
               "--from-traffic", str(folder), "--resume", args.head, "--minutes",
               f"{budget:g}", "--data-share", f"{args.data_minutes / budget:.3f}",
               "--no-progress"]
    shutil.rmtree(work / "head", ignore_errors=True)  # no checkpoint of an earlier try
    if subprocess.run(command).returncode:
        return 2  # (the training printed why)
    report = json.loads((work / "head" / "report.json").read_text())
    if report["held_out"] != sent["held_requests"]:
        print(f"error: training held out {report['held_out']} rows, not the "
              f"{sent['held_requests']} held-out requests", file=sys.stderr)
        return 2
    before, after = report["acceptance_length_untrained"], report["acceptance_length"]
    table = ("| head | " + " | ".join(f"k={k}" for k in range(1, len(after) + 1)) + " |\n|"
             + "---|" * (len(after) + 1) + "\n| as served (before) | "
             + " | ".join(f"{a:.2f}" for a in before) + " |\n| fine-tuned on the traffic | "
             + " | ".join(f"{a:.2f}" for a in after) + " |")
    result = (f"RESULT traffic_accept_len_k5_before={before[-1]:.2f} "
              f"traffic_accept_len_k5_after={after[-1]:.2f} traffic_requests={sent['requests']}")
    details = [
        f"served: configs/default.yaml with `speculative.record` on; {sent['held_requests']} "
        f"held-out requests ({sent['held_prompts']} prompts of bench/prompts/chat.jsonl and "
        f"code_edit.jsonl, greedy and at temperature 0.7; {sent['held_tokens']} answer tokens) "
        f"first, then {sent['requests']} requests over the other {sent['trained_prompts']} "
        f"prompts (temperature 0.7, a seed each, {args.concurrency} at a time, at most "
        f"{args.max_tokens} tokens; {sent['tokens']} answer tokens) in {sent['seconds']:.0f} s",
        f"fine-tuned: `specserve {' '.join(command[1:])}` (head {args.head}); "
        f"{report['conversations']} recorded conversations ({report['held_out']} held out: the "
        f"oldest), {report['answer_tokens']} answer tokens trained on, "
        f"{report['train_steps']} optimizer steps in {report['train_seconds'] / 60:.1f} min, "
        f"{report['data_seconds'] / 60:.1f} min teacher-forcing",
        "acceptance length: tokens per verification of k greedy drafts on the held-out "
        "conversations, teacher-forced (training/speculator.py `acceptance_lengths`)",
    ]
    print(table)
    print(result)
    write_results(args.out, "Learning from served traffic: a head fine-tuned on what it served",
                  torch.get_num_threads(), details, table, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
