"""The options of the retention rules, declared once (:data:`casckpt.retention_rules.RULES`),
for the commands that take them: ``casckpt retention set`` and ``casckpt mirror add``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Optional

import typer

from casckpt.cli.shared import FLAG
from casckpt.retention_rules import RULES, Rule


def _rule_option(rule: Rule, default: Any) -> inspect.Parameter:
    """The option for ``rule``: its flag, value and help, from its declaration."""
    if rule.kind.cli_type is bool:
        negated = rule.flag.replace("--", "--no-", 1)
        annotation: Any = Annotated[bool, typer.Option(f"{rule.flag}/{negated}", metavar=FLAG,
                                                       help=rule.meaning)]
    else:
        at_least = 1 if rule.kind.cli_type is int else None
        annotation = Annotated[Optional[rule.kind.cli_type],  # noqa: UP045  # a runtime value
                               typer.Option(rule.flag, metavar=rule.metavar, help=rule.meaning, min=at_least)]
    return inspect.Parameter(rule.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=annotation)


Command = Callable[..., None]


def with_rule_options(defaults: Mapping[str, Any] | None = None) -> Callable[[Command], Command]:
    """A decorator: ``command`` takes one option per retention rule (as ``**rules``), before
    ``--json`` (its last parameter but ``**rules``); ``defaults`` overrides rules' defaults."""
    chosen = dict(defaults or {})

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        *fixed, last, _ = signature.parameters.values()
        options = [_rule_option(rule, chosen.get(rule.name, rule.default)) for rule in RULES]
        command.__signature__ = signature.replace(  # type: ignore[attr-defined]  # what typer reads
            parameters=[*fixed, *options, last.replace(kind=inspect.Parameter.KEYWORD_ONLY)])
        return command

    return decorate


def parse_rules(rules: Mapping[str, Any]) -> dict[str, Any]:
    """The rules' values as the command line gave them, parsed (``"7d"`` -> seconds)."""
    given = {}
    for rule in RULES:
        value = rules[rule.name]
        parse = rule.kind.parse
        given[rule.name] = parse(rule.flag, value) if parse is not None and value is not None else value
    return given
