"""Kernels that give the same bits twice, so that a bitwise comparison of two training runs means something.

Offloading hands autograd back exactly the bytes it took, so a run with offloading and one without
end with bit-identical weights, provided every kernel in both runs is itself reproducible. On the
CPU they are. On an accelerator several are not by default: fused attention backward and some
cuBLAS configurations accumulate in an order that changes from run to run, so two runs *without*
offloading already differ, and a mismatch says nothing about offloading.

`DeterministicKernels` makes them reproducible where PyTorch can, records where it cannot, and
turns the comparison's outcome into a verdict that is never a false "NO":

    kernels = DeterministicKernels(device)     # first thing in main: before any CUDA work
    kernels.prepare(model)                     # eager attention, checked
    with kernels:                              # torch.use_deterministic_algorithms, warnings recorded
        ...  # both runs
    verdict = kernels.verdict(identical)       # yes / NO / cannot tell (...)
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
# The two settings with which PyTorch considers cuBLAS deterministic (and stops warning about it).
DETERMINISTIC_CUBLAS_WORKSPACES = (":4096:8", ":16:8")

EXIT_IDENTICAL = 0
EXIT_DIFFERENT = 1
EXIT_CANNOT_TELL = 3  # 2 is argparse's exit code for a usage error

# PyTorch's own texts, in warn_only mode: an op with no deterministic implementation, a fused
# attention backward that keeps its non-deterministic algorithm, and cuBLAS without a
# deterministic workspace.
_NO_DETERMINISTIC_IMPLEMENTATION = re.compile(r"(\S+) does not have a deterministic implementation")
_NON_DETERMINISTIC_ALGORITHM = re.compile(r"(.+?) defaults to a non-deterministic algorithm")
_CUBLAS_NOT_DETERMINISTIC = "this operation is not deterministic because it uses CuBLAS"
_FLAGGED_MESSAGE = (
    r".*(does not have a deterministic implementation|defaults to a non-deterministic algorithm"
    r"|this operation is not deterministic)"
)


@dataclass(frozen=True)
class Verdict:
    """The outcome of comparing a run with offloading against one without."""

    identical: bool
    # Why bitwise equality could not be expected; empty when the kernels are known to repeat.
    reasons: tuple[str, ...] = ()

    @property
    def word(self) -> str:
        if self.identical:
            return "yes"
        return "cannot tell" if self.reasons else "NO"

    @property
    def exit_code(self) -> int:
        if self.identical:
            return EXIT_IDENTICAL
        return EXIT_CANNOT_TELL if self.reasons else EXIT_DIFFERENT

    @property
    def explanation(self) -> str:
        """Why a difference proves nothing; empty unless the verdict is "cannot tell"."""
        if self.word != "cannot tell":
            return ""
        return f"non-deterministic kernels: {'; '.join(self.reasons)}; a bitwise comparison needs deterministic ones"

    def __str__(self) -> str:
        return f"{self.word} ({self.explanation})" if self.explanation else self.word

    def stated(self, what: str) -> str:
        """'yes (what)', 'NO (what)' or 'cannot tell (what; why)'."""
        return f"{self.word} ({what}; {self.explanation})" if self.explanation else f"{self.word} ({what})"


class DeterministicKernels:
    """Reproducible kernels for a bitwise comparison on `device`, and a record of what spoiled them.

    Create it before any CUDA work in the process: PyTorch reads CUBLAS_WORKSPACE_CONFIG once, at
    its first cuBLAS call. On the CPU it does nothing, since CPU kernels repeat bit for bit already;
    `needed=True` applies everything but the cuBLAS setting there too (the tests use it).
    """

    def __init__(self, device: str | torch.device | None = None, *, needed: bool | None = None) -> None:
        if device is None:
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            device = accelerator if accelerator is not None else "cpu"
        self.device_type = torch.device(device).type
        self.needed = self.device_type != "cpu" if needed is None else needed
        self.cublas_workspace: str | None = None
        self._problems: list[str] = []
        self._flagged: list[str] = []
        self._control: bool | None = None
        self._saved_mode: tuple[bool, bool] | None = None
        self._warnings_context: warnings.catch_warnings | None = None
        self._prepared = self._entered = False
        if self.needed and self.device_type == "cuda":
            self._pin_cublas_workspace()

    def _pin_cublas_workspace(self) -> None:
        value = os.environ.get(CUBLAS_WORKSPACE_VARIABLE)
        if value is None:
            if torch.cuda.is_initialized():
                # Its first cuBLAS call may be behind it; PyTorch would then keep the default workspace.
                self._problems.append(
                    f"{CUBLAS_WORKSPACE_VARIABLE} was set after CUDA had started (set it before any CUDA work)"
                )
            value = os.environ[CUBLAS_WORKSPACE_VARIABLE] = DETERMINISTIC_CUBLAS_WORKSPACES[0]
        elif value not in DETERMINISTIC_CUBLAS_WORKSPACES:
            self._problems.append(
                f"{CUBLAS_WORKSPACE_VARIABLE}={value} is not one of {', '.join(DETERMINISTIC_CUBLAS_WORKSPACES)}"
            )
        self.cublas_workspace = value

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Switch `model` (a transformers model, or a wrapper such as a PEFT model) to eager attention.

        The fused attention kernels' backward (SDPA's flash and memory-efficient ones, flash-attn)
        is not deterministic by default; eager attention is a matmul and a softmax. The switch is
        checked on every transformers model inside `model`, and one that stays fused is a reason
        the verdict cannot be NO.
        """
        if not self.needed:
            return model
        self._prepared = True
        models = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
        if not models:
            self._add_problem(f"{type(model).__name__} holds no transformers model to switch to eager attention")
            return model
        for module in models:
            if _attention_of(module) != "eager":
                try:
                    module.set_attn_implementation("eager")
                except (ValueError, ImportError) as error:  # checked below, like a refusal
                    self._add_problem(f"{type(module).__name__} refused eager attention: {error}")
        checked = set()  # a causal LM and its inner model share one config: one line for both
        for module in models:
            if id(module.config) not in checked and (attention := _attention_of(module)) != "eager":
                self._add_problem(f"attention in {type(module).__name__} is still {attention}, not eager")
            checked.add(id(module.config))
        return model

    def _add_problem(self, reason: str) -> None:
        if reason not in self._problems:  # the examples prepare one model per run
            self._problems.append(reason)

    def __enter__(self) -> DeterministicKernels:
        if not self.needed:
            return self
        if self._saved_mode is not None:
            raise RuntimeError("DeterministicKernels is already entered; enter it once around all runs")
        self._saved_mode = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        # warn_only: an op without a deterministic version should make the verdict "cannot tell",
        # not stop the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        self._entered = True
        self._warnings_context = warnings.catch_warnings()
        self._warnings_context.__enter__()
        # "always": PyTorch's warnings would otherwise show once per call site, and one already shown
        # before this block would go unrecorded.
        warnings.filterwarnings("always", message=_FLAGGED_MESSAGE)
        show_other = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if re.match(_FLAGGED_MESSAGE, text, re.DOTALL):
                self.note_warning(text)
            else:
                show_other(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._saved_mode is None:
            return
        self._warnings_context.__exit__(*exc_info)
        self._warnings_context = None
        enabled, warn_only = self._saved_mode
        self._saved_mode = None
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)

    def note_warning(self, text: str) -> None:
        """Record one of PyTorch's non-determinism warnings (the block above calls it for each)."""
        if match := _NO_DETERMINISTIC_IMPLEMENTATION.search(text):
            reason = f"{match.group(1)} has no deterministic implementation"
        elif match := _NON_DETERMINISTIC_ALGORITHM.search(text):
            reason = f"{match.group(1)} used its non-deterministic algorithm"
        elif _CUBLAS_NOT_DETERMINISTIC in text:
            reason = f"cuBLAS ran without {CUBLAS_WORKSPACE_VARIABLE}={DETERMINISTIC_CUBLAS_WORKSPACES[0]}"
        else:
            reason = text.split(". ")[0]
        if reason not in self._flagged:
            self._flagged.append(reason)

    def note_control(self, identical: bool) -> None:
        """The outcome of the control: two runs without offloading, which must be identical."""
        self._control = identical

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the runs need not be bit-identical even without offloading; empty if they must be."""
        reasons = [*self._problems, *self._flagged]
        if self.needed and not self._prepared:
            reasons.append("attention was not switched to eager (prepare() was not called)")
        if self.needed and not self._entered:
            reasons.append("the runs were not inside the deterministic block")
        if self._control is False:
            reasons.append("two runs without offloading differ")
        return tuple(reasons)

    def verdict(self, identical: bool) -> Verdict:
        """yes if the runs are identical, NO if they differ on reproducible kernels, else cannot tell."""
        return Verdict(identical=identical, reasons=() if identical else self.reasons)

    def describe(self) -> str:
        """One line saying what was done to make the kernels reproducible."""
        if not self.needed:
            return f"deterministic kernels: none needed on {self.device_type} (its kernels repeat bit for bit)"
        steps = ["eager attention", "torch.use_deterministic_algorithms(True, warn_only=True)"]
        if self.cublas_workspace is not None:
            steps.append(f"{CUBLAS_WORKSPACE_VARIABLE}={self.cublas_workspace}")
        return "deterministic kernels: " + ", ".join(steps)

    def describe_control(self) -> str | None:
        if self._control is None:
            return None
        outcome = "identical" if self._control else "DIFFER: these kernels do not repeat, whatever offloading does"
        return f"control, two runs without offloading: {outcome}"


def _attention_of(model: PreTrainedModel) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


Run = tuple[list[float], torch.nn.Module]  # a training run: its losses and the trained model


def same_tensors(first, second) -> bool:
    """Two equally long sequences of tensors, equal bit for bit pairwise."""
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def same_run(first: Run, second: Run) -> bool:
    """Equal losses and bit-identical trained weights."""
    (first_losses, first_model), (second_losses, second_model) = first, second
    return first_losses == second_losses and same_tensors(first_model.parameters(), second_model.parameters())


def losses_and_weights_verdict(losses: bool, weights: bool, reasons: tuple[str, ...]) -> tuple[Verdict, str]:
    """The verdict on a whole run (`losses` and `weights`: whether each came out bit-identical,
    `reasons`: why the kernels may not repeat) and its one-line report."""
    verdict = Verdict(losses and weights, reasons)
    line = f"bit-identical: losses {Verdict(losses, reasons).word}, final weights {Verdict(weights, reasons).word}"
    return verdict, f"{line} ({verdict.explanation})" if verdict.explanation else line


def train_and_compare(train, *, compare: bool, control: bool) -> tuple[int, torch.nn.Module]:
    """The examples' `--compare` and `--control`: `train(offload, kernels)` returns a `Run`. Trains
    with offloading; with `compare`, also without it, and with `control` a second time without
    it, on deterministic kernels; prints the losses and a verdict that is never a false NO.
    Returns the exit status (EXIT_*) and the offloaded run's model. Call it before any CUDA work:
    it sets CUBLAS_WORKSPACE_CONFIG, which PyTorch reads at its first cuBLAS call."""
    compare = compare or control
    kernels = DeterministicKernels() if compare else None
    if kernels is not None:
        print(kernels.describe())
    exit_code = EXIT_IDENTICAL
    with kernels if kernels is not None else contextlib.nullcontext():
        losses, model = train(True, kernels)
        print("losses with offloading:   ", [round(loss, 6) for loss in losses])
        if compare:
            expected = train(False, kernels)
            print("losses without offloading:", [round(loss, 6) for loss in expected[0]])
            if control:
                kernels.note_control(same_run(expected, train(False, kernels)))
                print(kernels.describe_control())
            verdict = kernels.verdict(same_run((losses, model), expected))
            print(f"identical to the run without offloading: {verdict.stated('losses and trained weights')}")
            exit_code = verdict.exit_code
    return exit_code, model
