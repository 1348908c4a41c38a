"""ConcertinaTrainingArguments: fields, parsing, and the errors that name the field to change."""

from __future__ import annotations

import dataclasses

import os

import pytest
from transformers import HfArgumentParser

from concertina_hf.training.args import (
    ConcertinaTrainingArguments,
    in_trainer_terms,
    parse_memory_budget,
    resolve_parallel_sizes,
)
from concertina_hf.planning import PIPELINE_STRATEGIES, STRATEGIES, PlanError


def _args(tmp_path, **kw):
    return ConcertinaTrainingArguments(output_dir=str(tmp_path), report_to=[], **kw)


def test_every_concertina_field_has_help_and_parses_from_the_command_line(tmp_path):
    fields = [f for f in dataclasses.fields(ConcertinaTrainingArguments) if f.name.startswith("concertina_")]
    names = {f.name for f in fields}
    assert {"concertina_pipeline_size", "concertina_data_parallel_size", "concertina_memory_budget",
            "concertina_strategy", "concertina_max_tokens_per_chunk", "concertina_solver_time_limit",
            "concertina_replan_interval", "concertina_cost_model"} <= names
    assert all(len(f.metadata.get("help", "")) > 20 for f in fields)
    (args,) = HfArgumentParser(ConcertinaTrainingArguments).parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--report_to", "none", "--concertina_pipeline_size", "2",
        "--concertina_memory_budget", "3GiB,1GiB", "--concertina_strategy", "packed",
        "--concertina_max_tokens_per_chunk", "4096", "--concertina_cost_model", "online",
        "--concertina_replan_interval", "7", "--concertina_solver", "greedy", "--concertina_gantt_steps", "5",
    ])
    assert args.concertina_strategy == "packed" and args.concertina_max_tokens_per_chunk == 4096
    assert args.memory_budget == (3 * 2**30, 2**30)
    assert args.concertina_replan_interval == 7 and args.concertina_solver == "greedy"


@pytest.mark.parametrize("kw, field", [
    (dict(concertina_strategy="fastest"), "concertina_strategy"),
    (dict(concertina_solver="cplex"), "concertina_solver"),
    (dict(concertina_solver_time_limit=0.0), "concertina_solver_time_limit"),
    (dict(concertina_cost_model="measured"), "concertina_cost_model"),
    (dict(concertina_cost_model_path="/nonexistent/cost.json"), "concertina_cost_model_path"),
    (dict(concertina_cost_model="online", concertina_replan_interval=0), "concertina_replan_interval"),
    (dict(concertina_replan_interval=-1), "concertina_replan_interval"),
    (dict(concertina_gantt_steps=-2), "concertina_gantt_steps"),
    (dict(concertina_memory_budget="lots"), "concertina_memory_budget"),
    (dict(concertina_memory_budget="-3GiB"), "concertina_memory_budget"),
    (dict(concertina_memory_fraction=1.5), "concertina_memory_fraction"),
    (dict(concertina_pipeline_size=0), "concertina_pipeline_size"),
    (dict(concertina_data_parallel_size=-1), "concertina_data_parallel_size"),
    (dict(concertina_max_tokens_per_chunk=0), "concertina_max_tokens_per_chunk"),
    (dict(concertina_pipeline_size=2, concertina_memory_budget="1GiB,2GiB,3GiB"), "concertina_memory_budget"),
])
def test_invalid_settings_fail_at_construction_naming_the_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        _args(tmp_path, **kw)


def test_planner_errors_are_worded_in_the_arguments_fields():
    """The planner names its own settings; the trainer words them as its fields, keeping the
    error's type, its remedies and the smallest value that works."""
    import re

    from concertina_hf.planning import CostModel, DeviceSpec, InfeasiblePlanError, plan_step, partition_layers
    from concertina_hf.planning.presets import MODEL_PRESETS

    cost = CostModel.from_hf_config(MODEL_PRESETS["tiny-llama"], DeviceSpec.cpu())
    layout = partition_layers(cost, 2)
    with pytest.raises(PlanError) as e:
        plan_step([4000, 3000, 1000] + [1] * 4000, cost, layout, 0, max_tokens_per_chunk=1)
    worded = in_trainer_terms(e.value)
    assert type(worded) is type(e.value) and (worded.setting, worded.limit) == ("max_tokens_per_chunk", 16)
    assert "raise concertina_max_tokens_per_chunk to at least 16 tokens" in str(worded), str(worded)
    with pytest.raises(InfeasiblePlanError) as e:
        plan_step([4000], cost, layout, int(cost.static_memory(layout, 0)) + 1)
    text = str(in_trainer_terms(e.value))
    assert "raise concertina_memory_budget" in text and "raise concertina_pipeline_size" in text, text
    assert not re.search(r"(?<!concertina_)(memory_budget|pipeline_size)", text), text


@pytest.mark.parametrize("field", ["gradient_checkpointing", "activation_checkpointing"])
def test_checkpointing_by_habit_is_left_to_the_planner_saying_so(tmp_path, field, caplog):
    """Either spelling is accepted (the planner decides recompute per chunk and stage); HF's
    checkpointing of every layer is switched off, and the log names the field the user set and
    the kwargs that have nothing to act on."""
    import transformers

    if field not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}:
        pytest.skip(f"transformers {transformers.__version__} has no {field} (only its older spelling)")
    with caplog.at_level("WARNING", logger="concertina_hf.training.args"):
        args = _args(tmp_path, **{field: True, f"{field}_kwargs": {"use_reentrant": True}})
    assert args.gradient_checkpointing is False and not args.gradient_checkpointing_kwargs
    # transformers < 5.2x (5.17 checked) has no activation_checkpointing* fields
    assert getattr(args, "activation_checkpointing", False) is False
    assert not getattr(args, "activation_checkpointing_kwargs", None)
    msgs = [r.getMessage() for r in caplog.records if r.name == "concertina_hf.training.args"]
    assert len(msgs) == 1 and msgs[0].startswith(f"{field}=True") and "use_reentrant" in msgs[0], msgs


def test_torch_compile_is_ignored_with_one_warning_saying_why(tmp_path, caplog, monkeypatch):
    import concertina_hf.training.args as mod

    monkeypatch.setattr(mod, "_COMPILE_WARNED", False)
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    with caplog.at_level("WARNING", logger="concertina_hf.training.args"):
        first = _args(tmp_path, torch_compile=True)
        second = _args(tmp_path, torch_compile_mode="max-autotune")
    assert not first.torch_compile and not second.torch_compile and second.torch_compile_mode is None
    assert "ACCELERATE_DYNAMO_BACKEND" not in os.environ  # nothing exported to accelerate
    msgs = [r.getMessage() for r in caplog.records if r.name == "concertina_hf.training.args"]
    assert len(msgs) == 1 and msgs[0].startswith("torch_compile is ignored") and "not compiled" in msgs[0], msgs


def test_precision_bf16_accepted_fp16_refused(tmp_path, monkeypatch):
    assert _args(tmp_path, use_cpu=True, bf16=True).mixed_precision == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        _args(tmp_path, fp16=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what an accelerate config's mixed_precision sets
    with pytest.raises(ValueError, match="mixed_precision: bf16"):
        _args(tmp_path)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert _args(tmp_path, use_cpu=True).mixed_precision == "bf16"


def test_world_size_checks_against_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="concertina_pipeline_size=3 does not divide"):
        _args(tmp_path, concertina_pipeline_size=3)
    with pytest.raises(ValueError, match="product is the number of processes"):
        _args(tmp_path, concertina_pipeline_size=2, concertina_data_parallel_size=3)


def test_parallel_sizes_and_budgets():
    assert resolve_parallel_sizes(8, None, None) == (8, 1)
    assert resolve_parallel_sizes(8, 4, None) == (4, 2)
    assert resolve_parallel_sizes(8, None, 2) == (4, 2)
    assert resolve_parallel_sizes(1, None, None) == (1, 1)
    with pytest.raises(ValueError, match="concertina_data_parallel_size=3"):
        resolve_parallel_sizes(8, None, 3)
    assert parse_memory_budget("auto") == "auto"
    assert parse_memory_budget("none") is None and parse_memory_budget("0") is None
    assert parse_memory_budget("40GiB") == (40 * 2**30,)
    assert parse_memory_budget("1.5GB") == (1_500_000_000,)
    assert parse_memory_budget(1024) == (1024,)


def test_strategies_are_the_planners(tmp_path):
    """The run's setup plans with the chosen strategy: its plans are that strategy's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from concertina_hf.planning import ChunkKind, plan_step
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.run_setup import resolve_run

    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=4, num_attention_heads=4,
                                                         num_key_value_heads=2))
    plans = {}
    for s in PIPELINE_STRATEGIES:
        setup = resolve_run(_args(tmp_path, concertina_strategy=s, concertina_max_tokens_per_chunk=64), model,
                            Topology(1, 0, 1, 1, 0, 0))
        plans[s] = plan_step([300, 40, 200, 17], setup.cost_model, setup.layout, setup.budgets, setup.strategy,
                             max_tokens_per_chunk=setup.max_tokens_per_chunk).validate()
    assert {r for row in plans["no-recompute"].recompute for r in row} == {0}
    assert {r for row in plans["full-recompute"].recompute for r in row} == {4}  # every layer of the one stage
    assert all(c.kind is ChunkKind.PACKED for c in plans["packed"].chunks)  # whole sequences
    assert any(c.kind is not ChunkKind.PACKED for c in plans["split"].chunks)  # the 300 in slices of <= 64
    # sp-only is a simulated baseline on another layout: the trainer refuses it, naming it
    for s in set(STRATEGIES) - set(PIPELINE_STRATEGIES):
        with pytest.raises(ValueError, match=f"concertina_strategy='{s}' is a baseline"):
            _args(tmp_path, concertina_strategy=s)


def test_doctests_pass():
    import doctest

    from concertina_hf.training import args as args_module

    result = doctest.testmod(args_module)
    assert result.attempted >= 1 and result.failed == 0


def test_options_doc_states_the_defaults_of_the_arguments_and_of_the_recipe():
    """One truth per default: docs/options.md gives each concertina_* field's default
    as the dataclass has it (and lists every field); its recipe sentence gives RECIPE_DEFAULTS."""
    import importlib.util
    import pathlib
    import re
    import sys

    from concertina_hf import ConcertinaTrainingArguments

    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "docs" / "options.md").read_text()
    table = dict(re.findall(r"^\| `(concertina_\w+)` \| `([^`]*)` \|", readme, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(ConcertinaTrainingArguments)
              if f.name.startswith("concertina_")}
    assert set(table) == set(fields), set(table) ^ set(fields)
    for name, default in fields.items():
        assert table[name] == repr(default), (name, table[name], default)
    spec = importlib.util.spec_from_file_location("train_long_context", root / "recipes" / "train_long_context.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    sentence = " ".join(readme.split("The recipe sets its own for the embedded", 1)[1].split("\n\n", 1)[0].split())
    for key, value in recipe.RECIPE_DEFAULTS.items():
        if key.startswith("concertina_"):
            assert f"`{key}={value}`" in sentence, (key, value, sentence)
    assert f"{recipe.RECIPE_DEFAULTS['max_steps']} steps" in sentence


def test_balanced_replicas_need_the_global_token_average(tmp_path):
    """Balanced replicas run different numbers of tokens: only the loss normalised over the whole
    global batch equals Trainer's, so average_tokens_across_devices=False is refused, naming both."""
    from concertina_hf.runtime.distributed import Topology
    from concertina_hf.training.step_reader import ReplicaBalancer, replica_balancer

    two = Topology(2, 0, 1, 2, 0, 0)
    args = _args(tmp_path, average_tokens_across_devices=False)
    with pytest.raises(ValueError, match="concertina_balance_replicas.*average_tokens_across_devices"):
        replica_balancer(args, None, two)
    assert isinstance(replica_balancer(_args(tmp_path), None, two), ReplicaBalancer)
    assert replica_balancer(_args(tmp_path, concertina_balance_replicas=False), None, two) is None
    assert replica_balancer(args, None, Topology(1, 0, 1, 1, 0, 0)) is None  # one replica: nothing to balance
