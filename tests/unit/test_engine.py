"""The engine's pieces that need no second process: the DeepSpeed config, accelerate's
variables, fp16 loss scaling on CPU, activation checkpointing."""

import json
import logging

import pytest
import torch

from aiayn.config import load_config
from aiayn.distributed.env import DistEnv
from aiayn.distributed.launcher import accelerate_overrides
from aiayn.engine import deepspeed_config, registry
from aiayn.engine.ddp_engine import LocalEngine
from aiayn.engine.loss import batch_loss
from aiayn.engine.registry import build_engine
from aiayn.errors import ConfigError
from aiayn.model import build_model
from aiayn.model.layers import FeedForward
from aiayn.model.transformer import DecoderState

from batches import TINY, padded_batch
from helpers import SMALL_MODEL  # tests/helpers.py

BASE = ["data.train=corpus/train", "data.max_len=30"]


def cfg_with(*overrides):
    return load_config(None, [*BASE, "distributed.backend=deepspeed", *overrides])


def test_generated_deepspeed_config_follows_the_run_config():
    cfg = cfg_with(
        "distributed.zero_stage=2",
        "distributed.offload_optimizer=true",
        "train.grad_accum=4",
        "train.clip_norm=1.5",
        "train.precision=bf16",
        "optim.weight_decay=0.01",
    )
    ds = deepspeed_config.generate(cfg, world_size=8, device_type="cpu")
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 4 * 8 * ds["train_micro_batch_size_per_gpu"]
    assert ds["managed_gradient_accumulation"] is False
    # With the batch fixed over all ranks, DeepSpeed's accumulation is each rank's share.
    fixed = cfg_with("train.tokens_per_step=3200", "train.max_tokens=400")
    ds_fixed = deepspeed_config.generate(fixed, world_size=2, device_type="cpu")
    assert ds_fixed["gradient_accumulation_steps"] == 4 and ds_fixed["train_batch_size"] == 8
    assert ds["gradient_clipping"] == 1.5
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "Adam" and params["adam_w_mode"] is False
    assert params["betas"] == [0.9, 0.98] and params["eps"] == 1e-9
    assert params["weight_decay"] == 0.01
    assert params["torch_adam"] is False  # offload runs DeepSpeedCPUAdam
    assert ds["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": [],
    }
    assert "fp16" not in ds and "bf16" not in ds

    fp16 = deepspeed_config.generate(
        cfg_with("train.precision=fp16", "optim.name=adamw"), 1, "cuda"
    )
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic
    assert fp16["fp16"]["initial_scale_power"] == 16  # 2^16, train.loss_scale_init's default
    start = cfg_with("train.precision=fp16", "train.loss_scale_init=128")
    assert deepspeed_config.generate(start, 1, "cuda")["fp16"]["initial_scale_power"] == 7
    assert fp16["optimizer"]["type"] == "AdamW" and fp16["optimizer"]["params"]["adam_w_mode"]
    assert fp16["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_deepspeed_steps_torch_fused_adam_except_with_offload(device_type):
    """On CUDA too: DeepSpeed's own FusedAdam compiles with nvcc inside deepspeed.initialize
    and keeps an int step. tests/distributed/test_deepspeed.py builds from this config."""
    for name, torch_name in (("adam", "Adam"), ("adamw", "AdamW")):
        cfg = cfg_with(f"optim.name={name}", "distributed.zero_stage=2", "train.precision=bf16")
        ds = deepspeed_config.generate(cfg, world_size=2, device_type=device_type)
        params = ds["optimizer"]["params"]
        assert params["torch_adam"] is True and params["fused"] is True
        # DeepSpeed picks torch.optim.AdamW where the type is AdamW or adam_w_mode is set.
        assert ds["optimizer"]["type"] == torch_name and params["adam_w_mode"] == (name == "adamw")
        # Every reduction in fp32, as DDP's: no module's weights reduced in bf16.
        assert ds["torch_autocast"]["lower_precision_safe_modules"] == []
    offload = cfg_with("distributed.zero_stage=2", "distributed.offload_optimizer=true")
    params = deepspeed_config.generate(offload, 2, device_type)["optimizer"]["params"]
    assert params["torch_adam"] is False and "fused" not in params  # DeepSpeedCPUAdam


def test_extra_keys_merge_and_contradictions_are_errors(tmp_path):
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "comms_logger": {}}))
    cfg = cfg_with("distributed.zero_stage=3", f"distributed.deepspeed_config={extra}")
    ds = deepspeed_config.build(cfg, 2, "cpu")
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert ds["comms_logger"] == {}

    extra.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 5.0}))
    with pytest.raises(ConfigError) as err:
        deepspeed_config.build(cfg, 2, "cpu")
    message = str(err.value)
    assert "zero_optimization.stage: file says 2, the run config gives 3" in message
    assert "gradient_clipping: file says 5.0, the run config gives 0.0" in message

    extra.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        deepspeed_config.build(cfg, 2, "cpu")
    cfg.distributed.deepspeed_config = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="file not found"):
        deepspeed_config.build(cfg, 2, "cpu")


def test_deepspeed_reports_wait_for_no_device_unless_a_file_turns_them_on(tmp_path, caplog):
    """DeepSpeed's throughput timer is on and synchronized by default: a device sync at every
    forward (each micro-batch) and every step. The generated config turns it off, and the
    per-phase timers; a user's file may turn them back on (its values win, merged into ours),
    and the start then logs each that waits for the device. The engine that DeepSpeed builds
    from it is checked with real ranks (tests/distributed/test_step_collectives.py)."""
    ds = deepspeed_config.build(cfg_with("distributed.zero_stage=3"), 2, "cuda")
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    assert ds["wall_clock_breakdown"] is False and "comms_logger" not in ds
    assert deepspeed_config.device_waits(ds) == []
    assert deepspeed_config.device_waits({}) == [  # DeepSpeed's defaults
        "timers.throughput.synchronized: a device sync at every forward and step"
    ]

    extra = tmp_path / "reports.json"
    reports = {"timers": {"throughput": {"enabled": True}}, "steps_per_print": 10}
    extra.write_text(json.dumps(reports))
    cfg = cfg_with("distributed.zero_stage=3", f"distributed.deepspeed_config={extra}")
    ds = deepspeed_config.build(cfg, 2, "cuda")
    # Timed on the host, unsynchronized: it waits for nothing.
    assert ds["timers"] == {"throughput": {"enabled": True, "synchronized": False}}
    assert ds["steps_per_print"] == 10 and deepspeed_config.device_waits(ds) == []

    reports = {
        "timers": {"throughput": {"synchronized": True}},
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": False},  # DeepSpeed turns it on all the same
    }
    extra.write_text(json.dumps(reports))
    with caplog.at_level(logging.INFO, logger="aiayn"):
        ds = deepspeed_config.build(cfg, 2, "cuda")
    assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": True}}
    waits = deepspeed_config.device_waits(ds)
    assert [w.split(" ")[0] for w in waits] == ["wall_clock_breakdown", "comms_logger"]
    assert all(w in caplog.text for w in waits)

    # The file's values win only under those keys: elsewhere a contradiction is an error.
    extra.write_text(json.dumps({"timers": {}, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="zero_optimization.stage: file says 2"):
        deepspeed_config.build(cfg, 2, "cuda")


def test_shipped_deepspeed_files_agree_with_the_shipped_configs(project_root):
    from pathlib import Path

    files = sorted(Path(project_root, "configs", "deepspeed").glob("*.json"))
    assert files
    for path in files:
        for stage in (1, 2, 3):
            cfg = cfg_with(
                f"distributed.zero_stage={stage}", f"distributed.deepspeed_config={path}"
            )
            deepspeed_config.build(cfg, 2, "cpu")  # no contradiction


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distributed.zero_stage=2"], "need distributed.backend=deepspeed"),
        (
            ["distributed.backend=deepspeed", "distributed.offload_optimizer=true"],
            "offload_optimizer needs distributed.zero_stage >= 1",
        ),
        (
            [
                "distributed.backend=deepspeed",
                "distributed.zero_stage=2",
                "distributed.offload_params=true",
            ],
            "offload_params needs distributed.zero_stage=3",
        ),
        (
            ["distributed.backend=deepspeed", "train.compile=true"],
            "train.compile is not for distributed.backend deepspeed",
        ),
        (["distributed.backend=deepspeeed"], "is no engine; .* did you mean deepspeed"),
        (["distributed.fsdp.reshard_after_forward=false"], "fsdp need distributed.backend=fsdp"),
        (["distributed.backend=fsdp", "train.precision=fp16"], "fp16 with distributed.backend"),
    ],
)
def test_inconsistent_distributed_settings_are_refused(overrides, message):
    cfg = load_config(None, [*BASE, *overrides])  # each section holds; the engine refuses
    with pytest.raises(ConfigError, match=message):
        registry.check(cfg)


def test_accelerate_variables_become_overrides():
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
    }
    assert accelerate_overrides(env) == [
        "distributed.backend=deepspeed",
        "distributed.zero_stage=3",
        "distributed.offload_optimizer=true",
        "train.grad_accum=2",
        "train.precision=bf16",
    ]
    # --multi_gpu with accelerate's default precision changes nothing; no accelerate, nothing;
    # `accelerate config`'s default accumulation leaves train.tokens_per_step's to the config.
    assert accelerate_overrides({"ACCELERATE_MIXED_PRECISION": "no"}) == []
    assert accelerate_overrides({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1"}) == []
    assert accelerate_overrides({}) == []
    with pytest.raises(ConfigError, match="only cpu offload"):
        accelerate_overrides({**env, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"})


def engine_for(*overrides) -> LocalEngine:
    cfg = load_config(None, [*TINY, *overrides])
    torch.manual_seed(0)
    return build_engine(build_model(cfg.model, 50, 0), cfg, DistEnv(0, 1, torch.device("cpu")))


def test_fp16_overflow_skips_the_step_and_the_schedule_then_training_goes_on():
    assert engine_for("train.precision=fp16").loss_scale == 2.0**16
    engine = engine_for("train.precision=fp16", "train.loss_scale_init=1024")
    before = [p.detach().clone() for p in engine.module.parameters()]
    scale, lr = engine.loss_scale, engine.lr
    assert scale == 1024
    engine.backward(
        torch.tensor(float("inf"), requires_grad=True)
        * sum(p.sum() for p in engine.module.parameters())
    )
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scale == scale / 2
    assert engine.lr == lr  # the schedule counts applied updates only
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))

    batch = padded_batch()
    with engine.autocast():
        loss, _ = batch_loss(engine.model, batch, "seq2seq", 0.1, 0)
    engine.backward(loss / batch.n_tokens)
    engine.step()
    assert engine.skipped_steps == 1 and engine.lr > lr
    assert not all(
        torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True)
    )
    state = engine.state_dict()
    restored = engine_for("train.precision=fp16", "train.loss_scale_init=1024")
    restored.load_state_dict(state, checkpoint=None)
    assert restored.loss_scale == engine.loss_scale and restored.skipped_steps == 1


def test_activation_checkpointing_recomputes_each_layer_and_the_same_gradients_with_dropout():
    layers = 2  # TINY has N=1: one encoder and one decoder layer, each with one FFN
    grads, names = [], []
    for flag, backward_runs in (("false", 0), ("true", layers)):
        engine = engine_for("model.dropout=0.3", f"distributed.activation_checkpointing={flag}")
        runs = []  # one entry per FFN forward: inside what is checkpointed
        for m in engine.module.modules():
            if isinstance(m, FeedForward):
                m.register_forward_hook(lambda *_, runs=runs: runs.append(1))
        torch.manual_seed(1)
        batch = padded_batch()
        loss, _ = batch_loss(engine.model, batch, "seq2seq", 0.1, 0)
        assert len(runs) == layers
        engine.backward(loss)
        assert len(runs) == layers + backward_runs  # recomputed in the backward pass
        with torch.no_grad():  # evaluation runs each layer once, checkpointing or not
            batch_loss(engine.model, batch, "seq2seq", 0.1, 0)
        assert len(runs) == 2 * layers + backward_runs
        grads.append([p.grad.clone() for p in engine.module.parameters()])
        names.append([n for n, _ in engine.module.named_parameters()])
    assert names[0] == names[1]  # checkpoints load with or without it
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def two_batch_shapes():
    """Two padded batches of different shapes: the second makes torch.compile recompile."""
    return padded_batch(rows=4), padded_batch(rows=6, src_len=7, tgt_len=11)


@pytest.mark.slow  # TorchInductor compiles C++ for each layer kind and shape: about a minute
def test_compiled_layers_give_eager_gradients_under_the_same_parameter_names():
    """train.compile: each layer through TorchInductor, on two batch shapes (the second
    recompiles), against the eager model; checkpoints must not see a difference."""
    # The distributed tests' model, dropout 0 as theirs: the layers TorchInductor compiles
    # here are the second pass's compiled DDP ranks' (test_ddp.py), which then find them in
    # TorchInductor's cache instead of compiling them again (that test: 56 CPU-s against 65
    # cold, measured). Dropout 0 also because the same masks would need the same RNG calls.
    small = [f"model.{k}={SMALL_MODEL[k]}" for k in ("d_model", "d_ff", "h")]
    eager = engine_for("model.dropout=0", *small)
    compiled = engine_for("model.dropout=0", *small, "train.compile=true")
    assert list(compiled.module.state_dict()) == list(eager.module.state_dict())
    for batch in two_batch_shapes():
        losses = []
        for engine in (eager, compiled):
            loss, _ = batch_loss(engine.model, batch, "seq2seq", 0.1, 0)
            engine.backward(loss / batch.n_tokens)
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        for (name, a), b in zip(
            eager.module.named_parameters(), compiled.module.parameters(), strict=True
        ):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
        eager.step()
        compiled.step()
    model = compiled.module
    layers = [*model.encoder.layers, *model.decoder.layers]
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in eager.module.decoder.layers)

    # An eager checkpoint loads into the compiled model, and incremental decoding (the layers
    # write their key/value caches) gives the eager logits step by step.
    model.load_state_dict(eager.module.state_dict())
    src = padded_batch(rows=3, src_len=6).src
    with torch.no_grad():
        steps = []
        for m in (eager.module.eval(), model.eval()):
            memory, src_mask = m.encode(src)
            state, last, logits = DecoderState(), torch.full((3, 1), 1), []
            for _ in range(4):
                logits.append(m.decode(last, memory, src_mask, state)[:, -1])
                last = logits[-1].argmax(dim=-1, keepdim=True)
            steps.append(torch.stack(logits))
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_layers_draw_dropout_in_one_graph_and_checkpointing_replays_it():
    from torch._dynamo.utils import counters

    counters.clear()
    grads = []
    for flag in ("false", "true"):
        engine = engine_for(
            "model.dropout=0.3",
            "train.compile=true",
            f"distributed.activation_checkpointing={flag}",
        )
        torch.manual_seed(1)
        for batch in two_batch_shapes():
            loss, _ = batch_loss(engine.model, batch, "seq2seq", 0.1, 0)
            engine.backward(loss / batch.n_tokens)
        grads.append([p.grad.clone() for p in engine.module.parameters()])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert any(not torch.equal(g, torch.zeros_like(g)) for g in grads[0])
