"""What a deployment says about its quantization: the workers' Redis records and their gRPC ``Info``
replies carry the checkpoint's ``quant_method`` and the KV cache dtype, ``/v1/models`` reports both, and the gateway resolves a
``.gguf`` model with ``--quantization`` as the workers do (not to a float32 conversion of its own).
No model, no processes."""

from __future__ import annotations

import types

import pytest

from fuseserve.cli import build_parser
from fuseserve.messages import WorkerRecord
from fuseserve.model_source import quantization_method


def test_quantization_method_reads_the_checkpoint_config():
    cfg = lambda qc: types.SimpleNamespace(quantization_config=qc)  # noqa: E731
    assert quantization_method(types.SimpleNamespace()) is None
    assert quantization_method(cfg({"quant_method": "GPTQ", "bits": 4})) == "gptq"
    assert quantization_method(cfg({"quant_method": "gguf", "modules": {"model.layers.0.mlp": {}}})) == "gguf"
    # a GGUF file's float32 conversion keeps transformers' entry, naming no quantized module
    assert quantization_method(cfg({"quant_method": "gguf", "dequantize": False, "gguf_file": "x"})) is None
    assert quantization_method(cfg(types.SimpleNamespace(quant_method="awq"))) == "awq"


def test_worker_record_carries_quantization_and_kv_dtype_and_reads_old_records():
    rec = WorkerRecord(
        "w", "h:1", "m", 16, 10, 512, 100, [2], 64, quantization="gguf", kv_cache_dtype="float8_e4m3fn"
    )
    back = WorkerRecord.decode(rec.encode())
    assert (back.quantization, back.kv_cache_dtype) == ("gguf", "float8_e4m3fn")
    old = rec.encode().replace(', "quantization": "gguf", "kv_cache_dtype": "float8_e4m3fn"', "")
    assert "kv_cache_dtype" not in old
    assert WorkerRecord.decode(old).kv_cache_dtype is None


def test_info_reply_carries_quantization_and_kv_dtype_over_grpc():
    from concurrent import futures

    import grpc

    from fuseserve.proto import worker_pb2 as pb
    from fuseserve.proto import worker_pb2_grpc as pb_grpc
    from fuseserve.worker.runner import WorkerInfo
    from fuseserve.worker.server import WorkerServicer

    def info(**kw) -> pb.WorkerInfo:
        runner = types.SimpleNamespace(info=WorkerInfo(16, 10, 512, 100, [2], "cpu", "float32", **kw))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, "w0", "m"), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                return pb_grpc.WorkerStub(channel).Info(pb.InfoRequest(), timeout=10)
        finally:
            server.stop(grace=None)

    got = info(quantization="gguf", kv_cache_dtype="float8_e4m3fn")
    assert (got.worker_id, got.dtype, got.quantization, got.kv_cache_dtype) == (
        "w0", "float32", "gguf", "float8_e4m3fn"
    )  # fmt: skip
    plain = info()  # float weights, no KV cache (a simulated worker): the fields stay unset
    assert (plain.quantization, plain.kv_cache_dtype) == ("", "")


def test_model_card_reports_quantization_and_kv_cache_dtype():
    from fuseserve.gateway.served_models import ServedModels
    from fuseserve.gateway.utilities import model_card

    gw = types.SimpleNamespace(
        model_name="m",
        max_model_len=512,
        source=types.SimpleNamespace(quantization=None),
        served=ServedModels(["m"]),
    )
    rec = lambda kv, q=None: WorkerRecord(
        "w", "h:1", "m", 16, 10, 512, 100, [2], 64, quantization=q, kv_cache_dtype=kv
    )  # noqa: E731
    card = model_card(gw, "m", [rec("float8_e4m3fn", "gguf")])
    assert card["quantization"] == "gguf" and card["kv_cache_dtype"] == "float8_e4m3fn"
    card = model_card(gw, "m", [rec("float8_e4m3fn"), rec("bfloat16")])
    assert card["kv_cache_dtype"] == ["bfloat16", "float8_e4m3fn"] and card["quantization"] is None
    gw.source.quantization = "awq"  # no worker yet: the checkpoint's own, as the gateway resolved it
    card = model_card(gw, "m", [])
    assert card["quantization"] == "awq" and card["kv_cache_dtype"] is None


def test_gateway_resolves_the_model_with_its_quantization_flag(monkeypatch):
    from fuseserve.gateway import app
    from fuseserve.gateway.settings import settings_from_args

    args = build_parser().parse_args(["gateway", "--redis-url", "redis://x", "--quantization", "gguf"])
    settings = settings_from_args(args)
    assert settings.quantization == "gguf"
    seen = {}

    class Resolved(Exception):
        pass

    def fake_resolve(model, cache_dir=None, progress=True, quantization=None):
        seen.update(model=model, quantization=quantization)
        raise Resolved

    monkeypatch.setattr(app, "resolve_model", fake_resolve)
    with pytest.raises(Resolved):
        app.Gateway(settings)
    assert seen["quantization"] == "gguf"
