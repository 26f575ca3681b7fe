import dataclasses
from pathlib import Path

import pytest
import yaml

from aiayn.config import MODEL_PRESETS, Config, config_from_dict, keys_set, load_config
from aiayn.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def write(tmp_path, data) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unknown_key_is_an_error_that_suggests_the_nearest_key(tmp_path):
    path = write(tmp_path, {"data": {"train": "x"}, "model": {"dropuot": 0.3}})
    with pytest.raises(
        ConfigError, match=r"unknown key model\.dropuot; did you mean model\.dropout"
    ):
        load_config(path)


def test_unknown_section_suggests_the_section():
    with pytest.raises(ConfigError, match="unknown key trian; did you mean train"):
        config_from_dict({"trian": {"max_steps": 3}, "data": {"train": "x"}})


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {
                "data": {"train": "x"},
                "train": {"max_steps": "many", "max_tokens": 1.5},
                "model": {"norm": "middle"},
            }
        )
    text = str(err.value)
    assert "train.max_steps must be an integer, got 'many'" in text
    assert "train.max_tokens must be an integer" in text
    assert "model.norm must be one of post, pre" in text


def test_a_float_written_without_a_dot_is_a_number_in_yaml_and_on_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  train: x\nschedule:\n  factor: 1e-3\noptim:\n  betas: [9e-1, 98e-2]\n"
    )
    cfg = load_config(path, ["train.label_smoothing=5E-2", "optim.eps=1e-9"])
    assert cfg.schedule.factor == 0.001 and cfg.optim.betas == [0.9, 0.98]
    assert cfg.train.label_smoothing == 0.05 and cfg.optim.eps == 1e-9
    with pytest.raises(ConfigError, match="schedule.factor must be a number, got 'fast'"):
        load_config(path, ["schedule.factor=fast"])


def test_values_are_range_checked():
    with pytest.raises(
        ConfigError, match=r"model.d_model \(100\) must be divisible by model.h \(8\)"
    ):
        config_from_dict({"data": {"train": "x"}, "model": {"d_model": 100}})
    with pytest.raises(ConfigError, match="data.train is required"):
        config_from_dict({})


def test_precedence_is_command_line_over_yaml_over_preset_over_defaults(tmp_path):
    path = write(
        tmp_path,
        {
            "data": {"train": "x"},
            "model": {"preset": "transformer_big", "d_ff": 3000},
            "train": {"max_steps": 50, "seed": 7},
        },
    )
    cfg = load_config(path, ["train.max_steps=200", "model.h=8"])
    assert cfg.train.max_steps == 200  # command line over YAML
    assert cfg.train.seed == 7  # YAML over default
    assert cfg.model.d_ff == 3000  # YAML over preset
    assert cfg.model.h == 8  # command line over preset
    assert cfg.model.d_model == 1024 and cfg.model.dropout == 0.3  # preset over default
    assert cfg.train.grad_accum is None and cfg.train.accumulation(4) == 1  # default


def test_presets_are_table_3():
    assert MODEL_PRESETS["transformer_base"] == dict(N=6, d_model=512, d_ff=2048, h=8, dropout=0.1)
    assert MODEL_PRESETS["transformer_big"] == dict(N=6, d_model=1024, d_ff=4096, h=16, dropout=0.3)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["data.train=x", "model.preset=small", "optim.betas=[0.9, 0.99]"])
    cfg.save(tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg
    assert again.optim.betas == [0.9, 0.99]


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["train.max_steps"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def bounded_fields(values=None, prefix=""):
    """(dotted section, field, range) of every bounded field, in sections within sections too
    (decode.sampling)."""
    values = Config() if values is None else values
    for f in dataclasses.fields(values):
        inner = getattr(values, f.name)
        if dataclasses.is_dataclass(inner):
            yield from bounded_fields(inner, f"{prefix}{f.name}.")
        elif prefix and "range" in f.metadata:
            yield prefix[:-1], f.name, f.metadata["range"]


def _nested(section: str, value) -> dict:
    """{"decode": {"sampling": value}} for "decode.sampling"."""
    for part in reversed(section.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("section, name, bound", list(bounded_fields()))
def test_every_declared_range_refuses_the_value_past_each_end(section, name, bound):
    outside = []
    if bound.low is not None:
        outside.append(bound.low if bound.low_open else bound.low - 1)
    if bound.high is not None:
        outside.append(bound.high if bound.high_open else bound.high + 1)
    default = Config()
    for part in [*section.split("."), name]:
        default = getattr(default, part)
    for value in outside:
        raw_value = [value, value] if isinstance(default, list) else value
        with pytest.raises(ConfigError, match=rf"{section}\.{name} must be .*, got"):
            config_from_dict({"data": {"train": "x"}, **_nested(section, {name: raw_value})})


def test_the_ranges_are_declared_on_the_fields():
    declared = {f"{s}.{n}" for s, n, _ in bounded_fields()}
    assert {
        "model.dropout",
        "optim.betas",
        "schedule.factor",
        "schedule.cooldown",
        "schedule.cooldown_fraction",
        "distributed.zero_stage",
        "data.pad_to_multiple",
        "train.ema",
        "decode.sampling.top_p",
        "decode.noise.swap",
    } <= declared
    assert len(declared) == 65  # every numeric field with a bound


SHAKESPEARE = Path(__file__).parents[2] / "configs" / "tinyshakespeare_lm.yaml"


def test_a_smoke_test_override_of_max_steps_on_a_recipe_validates_and_scales_its_cooldown():
    cfg = load_config(SHAKESPEARE, ["train.max_steps=30"])
    assert cfg.schedule.cooldown_fraction == 0.2
    assert cfg.schedule.cooldown_steps(cfg.train.max_steps) == 6
    full = load_config(SHAKESPEARE)
    assert full.schedule.cooldown_steps(full.train.max_steps) == 380  # the recipe's measured run


def test_a_cooldown_given_both_ways_is_refused_naming_both_and_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(SHAKESPEARE, ["schedule.cooldown=0"])
    assert "schedule.cooldown (0) and schedule.cooldown_fraction (0.2) are both set" in str(
        err.value
    )
    assert "schedule.cooldown_fraction=null" in str(err.value)
    cfg = load_config(SHAKESPEARE, ["schedule.cooldown=50", "schedule.cooldown_fraction=null"])
    assert cfg.schedule.cooldown_steps(cfg.train.max_steps) == 50


@pytest.mark.parametrize("value", ["0.2", "380.0"])
def test_a_fraction_written_as_steps_is_refused_not_truncated(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train=x", f"schedule.cooldown={value}"])
    assert f"schedule.cooldown must be an integer or null, got {value}" in str(err.value)
    assert "a share of train.max_steps is schedule.cooldown_fraction" in str(err.value)


def test_a_cooldown_fraction_is_a_share_never_steps_or_percent():
    assert (
        load_config(None, ["data.train=x", "schedule.cooldown_fraction=1"])
        .schedule.in_steps(40)
        .cooldown
        == 40
    )  # 1 is the whole run, not one step
    with pytest.raises(ConfigError, match=r"cooldown_fraction must be in \(0, 1\], got 20"):
        load_config(None, ["data.train=x", "schedule.cooldown_fraction=20"])


def test_a_step_cooldown_longer_than_a_short_run_points_to_the_fraction():
    with pytest.raises(ConfigError) as err:
        load_config(SHAKESPEARE, ["train.max_steps=30", "schedule.cooldown=380",
                                  "schedule.cooldown_fraction=null"])  # fmt: skip
    assert "schedule.cooldown (380) must be at most train.max_steps (30)" in str(err.value)
    assert "schedule.cooldown_fraction" in str(err.value)


def test_cudnn_attention_with_deterministic_kernels_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="cuDNN's attention has no deterministic backward"):
        load_config(
            None, ["data.train=x", "train.deterministic=true", "train.attention_kernel=cudnn"]
        )
    with pytest.raises(ConfigError, match="attention_kernel"):
        load_config(None, ["data.train=x", "train.attention_kernel=fast"])
    cfg = load_config(
        None, ["data.train=x", "train.deterministic=true", "train.attention_kernel=math"]
    )
    assert cfg.train.attention_kernel == "math"


def test_the_first_fp16_loss_scale_must_be_a_power_of_two():
    with pytest.raises(
        ConfigError, match=r"loss_scale_init must be a power of two, got 1000 \(e.g. 1024\)"
    ):
        load_config(None, ["data.train=x", "train.loss_scale_init=1000"])
    assert load_config(None, ["data.train=x", "train.loss_scale_init=1"]).train.loss_scale_init == 1


def test_init_source_must_name_something():
    with pytest.raises(ConfigError, match=r"init.source is empty: name a run directory"):
        load_config(SHAKESPEARE, ["init.source=' '"])
    with pytest.raises(ConfigError, match=r"init.source must be a string or null, got \[1\]"):
        load_config(SHAKESPEARE, ["init.source=[1]"])


def test_keys_set_are_the_files_the_overrides_and_the_presets(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny}\ntrain: {max_steps: 5}\n")
    keys = keys_set(path, ["model.dropout=0.2", "init.source=runs/x"])
    assert {"model.preset", "model.N", "model.d_model", "model.dropout", "train.max_steps"} <= keys
    assert "init.source" in keys and "model.positions" not in keys and "train.seed" not in keys


def test_init_exclude_needs_a_source():
    with pytest.raises(
        ConfigError, match=r"init.exclude says how to start from init.source: set init.source"
    ):
        load_config(SHAKESPEARE, ['init.exclude=["decoder.*"]'])
    with pytest.raises(ConfigError, match=r"init.vocab says how to start from init.source"):
        load_config(SHAKESPEARE, ["init.vocab=remap"])
    with pytest.raises(ConfigError, match=r"init.vocab must be one of same, remap, got 'new'"):
        load_config(SHAKESPEARE, ["init.source=runs/x", "init.vocab=new"])


# ---- data.sources: a mixture -------------------------------------------------------------

MIX = [{"name": "news", "path": "a", "weight": 3}, {"name": "bt", "path": "b", "weight": 1}]


def mixture(*sources, **data) -> Config:
    return config_from_dict({"data": {"sources": list(sources or MIX), **data}})


def refusals(*sources, **data) -> str:
    with pytest.raises(ConfigError) as err:
        mixture(*sources, **data)
    return str(err.value)


def test_a_mixture_loads_and_round_trips_through_its_yaml(tmp_path):
    cfg = mixture({"name": "x", "path": "p", "weight": 1, "tag": "<bt>"}, epoch="largest")
    assert cfg.data.sources[0].tag == "<bt>" and cfg.data.sources[0].weight == 1.0
    cfg.save(tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_a_sources_entrys_unknown_key_and_wrong_type_are_named_with_its_index():
    text = refusals({"name": "a", "path": "p", "wieght": 1}, {"name": "b", "path": 3, "tag": []})
    assert "unknown key data.sources[0].wieght; did you mean data.sources[0].weight?" in text
    assert "data.sources[1].tag must be a string or null, got []" in text
    assert "data.sources must be a list of mappings, got 'news'" in str(
        pytest.raises(ConfigError, config_from_dict, {"data": {"sources": "news"}}).value
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weight": 0}, "data.sources[0].weight must be > 0, got 0"),
        ({"weight": -1.5}, "data.sources[0].weight must be > 0, got -1.5"),
        ({"name": "news/2019"}, "data.sources[0].name 'news/2019' must be letters, digits"),
        ({"name": ""}, "data.sources[0].name '' must be letters, digits"),
        ({"path": ""}, "data.sources[0].path is required"),
        ({"tag": "<b t>"}, "data.sources[0].tag '<b t>' must be one token"),
        ({"tag": ""}, "data.sources[0].tag '' must be one token"),
        ({"name": "bt"}, "data.sources: each name once; bt given twice"),
        ({"weight": None}, "data.sources news have no weight: give every source a weight"),
    ],
)
def test_a_bad_source_entry_is_refused_naming_it(change, message):
    assert message in refusals({**MIX[0], **change}, MIX[1])


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": "x"}, "data.train and data.sources are both set"),
        ({"temperature": 2.0}, "data.temperature sets every source's share: remove the weights"),
        ({"temperature": 0}, "data.temperature must be > 0, got 0"),
        ({"epoch": "source"}, "data.epoch=source counts one pass over data.epoch_source"),
        ({"epoch": "source", "epoch_source": "web"}, "must name a source (news, bt); got 'web'"),
        ({"epoch_source": "bt"}, "data.epoch_source is for data.epoch=source"),
        ({"epoch": "tokens"}, "data.epoch=tokens needs data.epoch_size"),
        ({"epoch_size": 100}, "data.epoch_size is for data.epoch=examples or tokens"),
        ({"epoch": "examples", "epoch_size": 0}, "data.epoch_size must be >= 1, got 0"),
        ({"epoch": "passes"}, "data.epoch must be one of sum, largest, source, examples, tokens"),
        (
            {"cache": False, "epoch": "tokens", "epoch_size": 9},
            "data.epoch=tokens needs the sources' mean lengths, which a stream does not have",
        ),
    ],
)
def test_a_bad_mixture_setting_is_refused_naming_it(data, message):
    assert message in refusals(**data)


def test_mixture_keys_without_sources_and_an_lm_mixture_are_refused():
    with pytest.raises(ConfigError, match="data.temperature, data.epoch describe a mixture"):
        config_from_dict({"data": {"train": "x", "temperature": 1.0, "epoch": "largest"}})
    with pytest.raises(ConfigError, match="a language model .model.kind lm. trains on data.train"):
        config_from_dict({"data": {"sources": MIX, "format": "text"}, "model": {"kind": "lm"}})
    cfg = mixture(*[{k: v for k, v in s.items() if k != "weight"} for s in MIX], temperature=5)
    assert cfg.data.temperature == 5.0
    streamed = mixture(cache=False, epoch="examples", epoch_size=1000)
    assert not streamed.data.cache and streamed.data.epoch_size == 1000
    assert mixture(cache=False, epoch="largest").data.epoch == "largest"


def test_tokens_per_step_fixes_the_batch_over_all_ranks_and_derives_each_ranks_share():
    cfg = load_config(
        None, ["data.train=x", "train.tokens_per_step=24576", "train.max_tokens=3072"]
    )
    assert [cfg.train.accumulation(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert {cfg.train.step_tokens(w) for w in range(1, 9)} == {24576}
    # A world size that does not divide them: the larger share, and its idle forwards.
    assert [cfg.train.accumulation(w) for w in (3, 5, 7)] == [3, 2, 2]
    assert [round(cfg.train.idle(w), 3) for w in (2, 3, 5, 7)] == [0, 0.111, 0.2, 0.429]
    # More ranks than micro-batches: the most that can, and the micro-batch that would fit
    # this one (never a silently rounded batch).
    with pytest.raises(ConfigError) as refused:
        cfg.train.accumulation(16)
    assert "fewer than the 16 ranks: run on at most 8 ranks" in str(refused.value)
    assert "on 16 ranks, train.max_tokens=1536 (1 a step on each rank)" in str(refused.value)
    with pytest.raises(ConfigError, match=r"run on at most 8 ranks\. Another max_tokens"):
        cfg.train.accumulation(9)  # 24576 is no multiple of 9 ranks' tokens: no max_tokens fits
    # grad_accum alone: the batch grows with the ranks, as before.
    old = load_config(None, ["data.train=x", "train.grad_accum=3", "train.max_tokens=100"])
    assert [old.train.step_tokens(w) for w in (1, 2)] == [300, 600]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.tokens_per_step=8192", "train.grad_accum=2"],
            r"are both set.*train.grad_accum=null",
        ),
        (  # explicitly 1 is still a second answer to the same question
            ["train.tokens_per_step=8192", "train.grad_accum=1"],
            "are both set",
        ),
        (
            ["train.tokens_per_step=25000", "train.max_tokens=4096"],
            r"6\.10 micro-batches.*24576 \(6\) or 28672 \(7\).*divisor of it: 3125, 2500, 1250",
        ),
    ],
)
def test_tokens_per_step_refuses_what_it_cannot_mean(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.train=x", *overrides])


def test_the_paper_configs_take_the_papers_batch_on_1_to_64_gpus(project_root):
    for name in ("base", "big"):
        cfg = load_config(Path(project_root) / f"configs/wmt14_en_de_{name}.yaml")
        assert {cfg.train.step_tokens(w) for w in range(1, 65)} == {24576}
        assert [cfg.train.accumulation(w) for w in (1, 8, 12, 64)] == [64, 8, 6, 1]
        assert cfg.train.idle(64) == 0 and round(cfg.train.idle(12), 3) == 0.111
        assert cfg.train.grad_accum is None and cfg.train.fuses()
        with pytest.raises(ConfigError, match="run on at most 64 ranks"):
            cfg.train.accumulation(65)


def test_unit_tokens_plans_the_step_in_units_that_ranks_fuse_into_forwards():
    cfg = load_config(
        None,
        ["data.train=x", "train.tokens_per_step=24576", "train.unit_tokens=384"]
        + ["train.max_tokens=3072"],
    )
    assert cfg.train.unit() == 384 and cfg.train.step_units(5) == 64
    assert cfg.train.batch(8) == (
        "384-token units x 64 shared by 8 ranks (8 each), fused into forwards of up to 3,072 tokens"
    )
    assert cfg.train.sharing(3) == (
        "64 shared by 3 ranks (1 takes 22, 2 take 21; 3% of the ranks' units idle), "
        "fused into forwards of up to 3,072 tokens"
    )
    # A unit as large as the forward: each unit one forward, as without unit_tokens.
    one = ["data.train=x", "train.tokens_per_step=6144", "train.unit_tokens=2048"]
    same = load_config(None, [*one, "train.max_tokens=3072"])
    assert not same.train.fuses() and same.train.sharing(3) == "1 accumulated x 3 ranks per step"
    with pytest.raises(ConfigError, match=r"3 units of train.unit_tokens \(2048\), fewer than "):
        same.train.accumulation(4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.unit_tokens=384"], r"tokens_per_step is not set.*train.unit_tokens=null"),
        (
            ["train.tokens_per_step=24576", "train.unit_tokens=500"],
            r"49\.15 units of train.unit_tokens \(500\).*or unit_tokens to a divisor",
        ),
        (
            ["train.tokens_per_step=24576", "train.unit_tokens=8192", "train.max_tokens=4096"],
            r"unit_tokens \(8192\) is larger than train.max_tokens \(4096\)",
        ),
    ],
)
def test_unit_tokens_refuses_what_it_cannot_mean(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.train=x", *overrides])


def test_decode_sampling_noise_and_n_best_are_checked_together():
    data = "data.train=x"
    cfg = load_config(
        None,
        [data, "decode.sampling.enabled=true", "decode.sampling.top_k=10", "decode.noise.swap=3"],
    )
    assert cfg.decode.sampling.top_k == 10 and cfg.decode.noise.swap == 3
    assert cfg.decode.sampling.top_p == 1.0 and cfg.decode.noise.drop == 0.0
    bad = [
        data,
        "decode.sampling.top_p=0",
        "decode.sampling.temperature=0",
        "decode.noise.drop=1.5",
        "decode.beam=4",
        "decode.n_best=5",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, bad)
    text = str(err.value)
    assert "decode.sampling.top_p must be in (0, 1]" in text
    assert "decode.sampling.temperature must be > 0" in text
    assert "decode.noise.drop must be 0..1" in text
    assert "decode.n_best 5 is more than decode.beam 4" in text and "decode.beam=5" in text
    with pytest.raises(ConfigError, match=r"did you mean decode\.sampling\.top_k\?"):
        load_config(None, [data, "decode.sampling.topk=3"])
    # n samples a sentence need no beam
    sampled = load_config(None, [data, "decode.sampling.enabled=true", "decode.n_best=5"])
    assert sampled.decode.n_best == 5
