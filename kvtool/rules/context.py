"""What a checker sees: the checkpoint, its ModelSpec, the options, and `report`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.model.checkpoint import Checkpoint
from kvtool.rules.registry import RULES, Finding, LintOptions
from kvtool.model.spec import ModelSpec


@dataclass
class LintContext:
    checkpoint: Checkpoint
    spec: ModelSpec
    options: LintOptions
    findings: list[Finding] = field(default_factory=list)

    @property
    def config(self) -> dict:
        """The text-model config (the inner dict for multimodal wrappers)."""
        return self.spec.config

    @property
    def config_file(self) -> str:
        return str(self.checkpoint.config_path)

    def file_of(self, name: str) -> str:
        """Display path of a file in the model folder."""
        root = self.checkpoint.root
        return str(root / name) if root is not None else name

    def report(self, code: str, message: str, *, path: str | None = None, file: str | None = None,
               hint: str | None = None, line: int | None = None, severity: str | None = None) -> None:
        """severity: only for rules whose severity an option raises (KV613 with --require-weights)."""
        rule = RULES[code]  # KeyError here means a checker used an undefined code: a bug
        if file is None:
            file = self.config_file
        if line is None and path and file == self.config_file:
            line = self.checkpoint.config_doc.line_of(path.split(".")[-1].split("[")[0])
        self.findings.append(Finding(
            code=code, name=rule.name, severity=severity or rule.severity.value, message=message, path=path, file=file,
            hint=hint if hint is not None else rule.hint, line=line,
        ))
