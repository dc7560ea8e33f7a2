"""Loading a :class:`~cppo.config.settings.TrainConfig`: a preset (``cppo/presets/NAME.yaml``) or a YAML file, then
``key=value`` overrides; a bad file or value is one error naming where it was set (the file and line, or the
``--set`` item), with the closest known name (TRL's names mapped to ours)."""

from __future__ import annotations

import difflib
import logging
import pathlib

import yaml

from ..fileio import cppo_program, shown_path
from .sections import FLAT_ROLLOUT_STOP
from .settings import TrainConfig, field_types, loss_field_types
from .values import coerce, did_you_mean

PRESET_DIR = pathlib.Path(__file__).resolve().parents[1] / "presets"


#: TRL's GRPOConfig / transformers' TrainingArguments names a user types, and what to use here.
TRL_NAMES = {
    "learning_rate": "lr",
    "num_generations": "group_size",
    "per_device_train_batch_size": "questions_per_step (questions per step; each brings group_size completions)",
    "gradient_accumulation_steps": "questions_per_step (one optimizer step per generation step here)",
    "num_iterations": "mu",
    "epsilon": "epsilon_low",
    "num_train_epochs": "num_epochs",
    "max_steps": "num_steps",
    "lr_scheduler_type": "lr_schedule",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "loss_type": "loss.loss_type=NAME (TRL's loss types: its surrogate and loss_agg)",
    "importance_sampling_level": "loss.importance_sampling=token|sequence",
    "bf16": "dtype=bfloat16",
    "fp16": "dtype=float16",
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "use_vllm": "rollout_backend=vllm",
    "pruning_metric": "selection_metric",
}


def _suggest(key: str, hints, value=None) -> str:
    """``" (TRL's name: use lr)"`` for a TRL / transformers name, ``" (an option of the loss: --set loss.NAME=VALUE
    ...)"`` for an option of the ``loss`` section, else the closest setting (:func:`did_you_mean`)."""
    if key in TRL_NAMES:
        return f" (that is TRL's name: here use {TRL_NAMES[key]})"
    if key in loss_field_types() and key != "compute_entropy":  # (the trainer sets that one itself)
        shown = "VALUE" if value is None else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
        return f" (an option of the loss: --set loss.{key}={shown.strip()}, or {key} under loss: in a YAML file)"
    close = difflib.get_close_matches(key, [*hints, *TRL_NAMES], n=1, cutoff=0.6)
    if close and close[0] in TRL_NAMES:
        return f" (did you mean TRL's {close[0]!r}? here use {TRL_NAMES[close[0]]})"
    return did_you_mean(key, hints)


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(preset_or_yaml: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A :class:`TrainConfig` from a preset name (``cppo/presets/NAME.yaml``) or a YAML file, then ``key=value``
    overrides (values parsed as YAML scalars).

    Raises:
        ValueError: naming where the bad setting came from (the file and line, or the ``--set`` item): malformed
            YAML, an unknown setting (with the closest known name), or a value the setting refuses.
    """
    path = pathlib.Path(preset_or_yaml)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ValueError(f"config file {shown_path(preset_or_yaml)} does not exist")
        preset = None
    else:
        if preset_or_yaml not in available_presets():
            raise ValueError(
                f"unknown preset {preset_or_yaml!r}{did_you_mean(preset_or_yaml, available_presets())}: the presets "
                f"are {available_presets()} (or pass a YAML path)"
            )
        preset, path = preset_or_yaml, PRESET_DIR / f"{preset_or_yaml}.yaml"
    values, origin = _read_yaml(path)
    for item in overrides:
        _apply_override(values, origin, item)
    _rollout_stop_from_flat(values, origin)
    hints = field_types()
    for key in values:
        if key not in hints:
            raise ValueError(
                f"{origin[key]}: unknown setting {key!r}{_suggest(key, hints, values[key])}; {cppo_program()} train "
                "--help lists them all"
            )
    values = {k: coerce(k, v, hints[k]) for k, v in values.items()}
    if isinstance(values.get("loss"), dict):  # its options parse as the flat settings do (1e-3: a number)
        options = loss_field_types()
        values["loss"] = {
            k: coerce(f"loss.{k}", v, options[k]) if k in options else v for k, v in values["loss"].items()
        }
    values.setdefault("preset", preset)
    try:
        config = TrainConfig(**values)
        config.check_sources()
        return config
    except ValueError as e:  # the checks mark the settings they refuse (naming): say where those were set
        where = [origin[name] for name in getattr(e, "settings", ()) if name in origin]
        if not where:
            raise
        raise ValueError(f"{'; '.join(dict.fromkeys(where))}: {e}") from None


def _apply_override(values: dict, origin: dict, item: str) -> None:
    """One ``--set key=value`` (the value parsed as YAML) onto ``values``; ``section.NAME=VALUE`` sets one option of
    a section (:data:`SECTIONS`), keeping the section's other options."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r} must look like key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"--set {item!r}: {raw!r} is not a YAML value ({_yaml_problem(e)})") from None
    section, dot, name = key.strip().partition(".")
    if dot and section in SECTIONS and name:
        held = values.get(section)
        values[section] = {**(held if isinstance(held, dict) else {}), name: value}
        origin[section] = f"{origin[section]} {item}" if section in origin else f"--set {item}"
        return
    values[key.strip()] = value
    origin[key.strip()] = f"--set {item}"


#: The sections of a config: ``loss:`` (the options of ``cppo_kernels.LossConfig``) and ``rollout_stop:`` (pruning
#: while generating: :mod:`cppo.config.sections`), each a setting of its own holding a mapping.
SECTIONS = ("loss", "rollout_stop")


def _rollout_stop_from_flat(values: dict, origin: dict) -> None:
    """The flat settings ``rollout_stop_NAME`` written before the ``rollout_stop:`` section, as the section's options
    they are now, each read with a pointer to the section; one also set in the section is refused, naming both (a
    section that is no mapping is refused by the config, naming where it was set)."""
    for key in [k for k in values if k in FLAT_ROLLOUT_STOP]:
        name, value, where = FLAT_ROLLOUT_STOP[key], values.pop(key), origin.pop(key)
        pointer = (
            f"rollout_stop.{name} now (--set rollout_stop.{name}=VALUE, or {name} under rollout_stop: in a YAML file)"
        )
        logging.getLogger("cppo").warning("%s: %s is read; it is %s", where, key, pointer)
        section = values.get("rollout_stop", {})
        if isinstance(section, dict) and name in section:
            raise ValueError(
                f"{origin['rollout_stop']}: rollout_stop.{name} is also set as {key} ({where}): set it once, under "
                "rollout_stop:"
            )
        if isinstance(section, dict):
            values["rollout_stop"] = {**section, name: value}
        origin["rollout_stop"] = f"{origin['rollout_stop']}; {where}" if "rollout_stop" in origin else where


#: Deepest nesting of a config file (settings are scalars, lists and the tiny model's flat mapping).
MAX_YAML_DEPTH = 16


def _read_yaml(path: pathlib.Path) -> tuple[dict, dict]:
    """The settings of a YAML file and where each was set (``"FILE, line N"``). Refused in one line naming the file:
    aliases (``*name``: a config needs none, and a few hundred bytes of them expand to gigabytes), nesting deeper
    than :data:`MAX_YAML_DEPTH`, and a key written twice in any mapping."""
    try:
        text = path.read_text(encoding="utf-8")
        _check_events(text, path)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config {str(path)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
    if values is None:
        return {}, {}
    if not isinstance(values, dict):
        raise ValueError(f"config {str(path)!r} must be a YAML mapping of settings, got {type(values).__name__}")
    _check_duplicates(node, path)
    lines = {key.value: key.start_mark.line + 1 for key, _ in node.value}
    return values, {k: f"{path}, line {lines.get(str(k), '?')}" for k in values}


def _check_events(text: str, path: pathlib.Path) -> None:
    """Walks the YAML event stream (no recursion, nothing built): aliases and deep nesting are refused."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise ValueError(f"{path}, line {line}: YAML aliases (*{event.anchor}) are not allowed in a config")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ValueError(f"{path}, line {line}: nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_duplicates(node: yaml.Node, path: pathlib.Path) -> None:
    """A key written twice in any mapping of the file is named (YAML keeps the last silently)."""
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.value in lines:
                raise ValueError(
                    f"{path}, line {line}: {key.value!r} is set twice (line {lines[key.value]} and {line})"
                )
            lines[key.value] = line
            _check_duplicates(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, path)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Where and what: ``line L, column C: PROBLEM`` (with what the parser was in, e.g. an unclosed list's line)."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    text = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: {e.problem}"
    if e.context and e.context_mark is not None:
        text += f" ({e.context} started at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return text
