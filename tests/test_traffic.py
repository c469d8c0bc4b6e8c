"""Served traffic kept for training draft heads (`speculative.record`) and training on it
(`specserve speculator train --from-traffic`)."""

import hashlib
import json
import time

import pytest
import torch

from conftest import build_tiny_model, build_tokenizer, make_engine, random_prompts
from engine import EngineConfig, SamplingParams
from engine.spec_decode.traffic import read_traffic
from training.speculator import (Collector, TrainOptions, _engine, encode, read_prompts,
                                 teacher_forced, train)

LAYERS = 4


def tiny_target(**kw):
    return build_tiny_model("qwen2", num_layers=LAYERS, **kw)


def recording(tmp_path, max_gb=1.0, target=None):
    return make_engine(target or tiny_target(), record={"dir": str(tmp_path / "traffic"),
                                                        "max_gb": max_gb})


def rows(folder):
    return [json.loads(line) for p in sorted(folder.glob("traffic-*.jsonl"))
            for line in p.read_text().splitlines()]


def test_finished_requests_are_recorded_per_tenant_and_nothing_else(tmp_path):
    engine = recording(tmp_path)
    prompts = random_prompts([6, 7, 8], seed=1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    salts = [None, "tenant-a-secret", "tenant-b-secret"]
    ids = [engine.add_request(p, params, cache_salt=s) for p, s in zip(prompts, salts)]
    outs = {}
    while len(outs) < 3:
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    root = tmp_path / "traffic"
    for prompt, salt, rid in zip(prompts, salts, ids):
        folder = root / ("shared" if salt is None else
                         "tenant-" + hashlib.sha256(salt.encode()).hexdigest()[:16])
        assert rows(folder) == [{"prompt": prompt, "output": outs[rid].output_token_ids}]
    written = "".join(p.read_text() for p in root.rglob("*") if p.is_file())
    assert "secret" not in written  # the salts themselves are not kept
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["meta.json", "shared"] + ["tenant-" + hashlib.sha256(s.encode()).hexdigest()[:16]
                                   for s in salts[1:]])


def test_an_aborted_request_is_not_recorded_and_recording_is_off_by_default(tmp_path):
    engine = recording(tmp_path)
    rid = engine.add_request(random_prompts([6], seed=2)[0],
                             SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(rid)
    assert not list((tmp_path / "traffic").rglob("traffic-*.jsonl"))
    plain = make_engine(tiny_target())
    assert plain.traffic is None


def test_recorded_traffic_rotates_within_max_gb(tmp_path):
    max_gb = 4096 / (1 << 30)  # 4 KiB: files of 256 bytes
    engine = recording(tmp_path, max_gb=max_gb)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([40] * 40, seed=3)
    outs = engine.generate(prompts, params)
    files = sorted((tmp_path / "traffic" / "shared").glob("traffic-*.jsonl"))
    total = sum(p.stat().st_size for p in files)
    assert len(files) > 2 and total <= 4096
    kept = rows(tmp_path / "traffic" / "shared")
    assert 0 < len(kept) < 40
    newest = [{"prompt": p, "output": o.output_token_ids} for p, o in zip(prompts, outs)]
    assert kept == [r for r in newest if r in kept] and kept[-1] in newest[-3:]


def test_bad_record_config_is_refused_with_the_option_named(tmp_path):
    for bad, name in (({"max_gb": 1}, "record.dir"), ({"dir": "x", "max_gb": -1},
                                                      "record.max_gb"),
                      ({"dir": "x", "size": 1}, "speculative.record"),
                      ("x", "record")):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            EngineConfig(speculative={"method": "none", "record": bad})
    recording(tmp_path)  # a folder of this target's traffic...
    with pytest.raises(ValueError, match=r"speculative\.record\.dir"):  # ...not another's
        recording(tmp_path, target=tiny_target(hidden_size=96))


def test_teacher_forced_features_are_the_serving_paths(tmp_path):
    """The features of a teacher-forced pass over the target's own answer are those the
    serving path computed (decoding row by row): within 2e-5 of the largest feature, fp32."""
    tok = build_tokenizer()
    opts = TrainOptions(target="tiny", out=str(tmp_path), max_new_tokens=16, concurrency=4,
                        quantization="none", dtype="float32", progress=False,
                        engine_overrides=dict(num_blocks=256, batch_invariant=False,
                                              cpu_matmul_autotune=False))
    collector = Collector(opts, _engine(opts, tiny_target(), tok), [1, 1, 0])
    prompts = [(i, encode(tok, p)) for i, p in enumerate(read_prompts(None)[:4])]
    collector.collect(prompts, time.monotonic() + 600, "test")
    served = collector.answered()
    target = collector.engine.runner.model
    for i, ids in prompts:
        ex = served[i]
        again = teacher_forced(target, [1, 1, 0], ex.ids.tolist(), len(ids))
        n = len(ex.features)
        scale = ex.features.float().abs().max()
        assert (again.features[:n].float() - ex.features.float()).abs().max() <= 2e-5 * scale
        rows_ = ex.mask.nonzero()[:, 0]
        assert torch.equal(again.top_ids[rows_], ex.top_ids[rows_])


def _serve_and_record(tmp_path, n):
    engine = recording(tmp_path)
    tok = build_tokenizer()
    prompts = [encode(tok, p) for p in read_prompts(None)[:n]]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    engine.close()
    return tmp_path / "traffic"


def _opts(tmp_path, folder, **kw):
    return TrainOptions(target="tiny", out=str(tmp_path / "head"), from_traffic=str(folder),
                        minutes=4, epochs=kw.pop("epochs", 3), quantization="none",
                        dtype="float32", draft_vocab_size=0, held_out=4, progress=False,
                        report_k=4, batch_tokens=32,
                        engine_overrides=dict(num_blocks=256, batch_invariant=False,
                                              cpu_matmul_autotune=False), **kw)


def test_a_head_learns_from_recorded_traffic_and_a_served_head_fine_tunes(tmp_path):
    root = _serve_and_record(tmp_path, 60)
    report = train(_opts(tmp_path, root / "shared"), model=tiny_target(),
                   tokenizer=build_tokenizer())
    before, after = report["acceptance_length_untrained"], report["acceptance_length"]
    assert report["conversations"] == 60 and after[3] > before[3] + 0.3, report
    again = train(_opts(tmp_path / "2", root / "shared", epochs=1,
                        resume=str(tmp_path / "head")),
                  model=tiny_target(), tokenizer=build_tokenizer())
    # it starts where the first head ended (the same held-out conversations)
    assert again["acceptance_length_untrained"] == pytest.approx(after, abs=1e-6)


def test_bad_traffic_folders_are_refused_clearly(tmp_path):
    root = _serve_and_record(tmp_path, 3)
    target = tiny_target()
    with pytest.raises(ValueError, match="holds the traffic of shared"):
        read_traffic(str(root), target)  # the root: pick one tenant's folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no recorded traffic"):
        read_traffic(str(tmp_path / "empty"), target)
    with pytest.raises(ValueError, match="another shape"):
        read_traffic(str(root / "shared"), tiny_target(hidden_size=96))
    first = sorted((root / "shared").glob("traffic-*.jsonl"))[0]
    first.write_text(first.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=rf"{first.name}:\d+ is not a recorded request"):
        read_traffic(str(root / "shared"), target)
    (root / "meta.json").write_text("{")
    with pytest.raises(ValueError, match="meta.json is missing or corrupt"):
        read_traffic(str(root / "shared"), target)


def test_the_server_records_its_tenants_traffic_apart(tmp_path):
    """Through the official client, two API keys (each its own cache_salt by default) and
    the engine in its own process: each key's finished answers land in its own folder."""
    import openai
    from server_utils import ServerProcess, save_tiny_model

    model = save_tiny_model(tmp_path / "tiny")
    cfg = tmp_path / "record.yaml"
    cfg.write_text(f"server:\n  engine_process: true\n  api_keys: [key-a, key-b]\n"
                   f"engine:\n  model: {model}\n  device: cpu\n  num_threads: 1\n"
                   f"  speculative:\n    method: none\n"
                   f"    record: {{dir: {tmp_path / 'traffic'}, max_gb: 0.01}}\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", "tiny"]).wait_ready()
    try:
        for key, n in (("key-a", 2), ("key-b", 1)):
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
            for _ in range(n):
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"hello {key}"}],
                    max_tokens=6, extra_body={"ignore_eos": True})
    finally:
        assert srv.terminate() == 0, srv.log()
    folders = sorted(p for p in (tmp_path / "traffic").iterdir() if p.is_dir())
    assert [len(rows(f)) for f in folders] in ([1, 2], [2, 1])
    assert all(r["output"] and len(r["output"]) == 6 for f in folders for r in rows(f))
