"""The real-time studies' speculative modes, by their short specs: ``saw:G``,
``pipe:GxD[:nocogen|:hedge]``, ``auto[:nocogen|:hedge|:predraft|:tree]``,
``hybrid[:predraft|:tree]``, ``cloud-sd`` and ``cloud-sd:ngram`` (what each one is:
:mod:`bench.studies.realtime`), each parsed to the edge's :class:`PipelineConfig` and the verifier
process it runs against. The simulation's modes are :class:`bench.lib.sim.SimMode`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edge_agent.session.pipeline_config import Mode, PipelineConfig
from shared.enums import TextEnum
from shared.maths.sampling import SamplingParams


class CloudSide(TextEnum):
    """The verifier process a mode runs against (each started once per group)."""

    PLAIN = "plain"  # verifies, co-generates one token a forward
    #: Speculates by itself: cloud_draft = tail, ngram and the cloud draft model (the grid's
    #: model draft, on the verifier, padded to the regime's cloud draft step).
    SPEC = "spec"
    NGRAM = "ngram"  # cloud_draft = ngram only (no model)


@dataclass(frozen=True)
class ModeSpec:
    """One speculative mode of the grid (module docstring): ``saw:G``,
    ``pipe:GxD[:nocogen|:hedge]``, ``auto[:nocogen|:hedge|:predraft|:tree]``,
    ``hybrid[:predraft|:tree]``."""

    spec: str
    kind: Mode
    gamma: int
    depth: int
    cogen: bool
    auto: bool = False
    hedge: int = 0  # tokens per hedge (PipelineConfig.hedge)
    predraft: int = 0  # branches prepared at most (PipelineConfig.predraft)
    #: The branches go to the verifier too (PipelineConfig.tree): always with ``predraft``,
    #: as the edge daemon's default; kept for the ``:tree`` label.
    tree: bool = False
    #: Which verifier process: the plain one, or one that speculates by itself.
    cloud: CloudSide = CloudSide.PLAIN
    #: False: no draft model on the edge (cloud-only speculative decoding, credits only).
    edge_draft: bool = True

    @property
    def label(self) -> str:
        """The summary's ``mode``."""
        if not self.edge_draft:
            return "cloud-sd" if self.cloud == CloudSide.SPEC else f"cloud-sd {self.cloud}"
        branches = " tree" if self.tree else " predraft" if self.predraft else ""
        if self.cloud != CloudSide.PLAIN:
            return "hybrid" + branches
        suffix = "" if self.cogen else " no-cogen"
        suffix += " hedge" if self.hedge else ""
        suffix += branches
        if self.auto:
            return "auto" + suffix
        if self.kind == Mode.STOP_AND_WAIT:
            return "stop-and-wait" if self.gamma == 4 else f"stop-and-wait γ={self.gamma}"
        return f"pipelined γ={self.gamma} D={self.depth}" + suffix

    def pipeline_config(self) -> PipelineConfig:
        return PipelineConfig(
            gamma=self.gamma,
            depth=self.depth,
            mode=self.kind,
            sampling=SamplingParams(0.0),
            cogen=self.cogen,
            auto_gamma=self.auto,
            auto_depth=self.auto,
            hedge=self.hedge,
            predraft=self.predraft,
            # the edge daemon's default: prepared branches go to the verifier too (token
            # trees where its step has room, else hedges for the co-generation after a
            # rejection); ``:tree`` names the same since that became the default
            tree=self.tree or self.predraft > 0,
        )


#: Branches prepared at most in the ``:predraft`` modes.
PREDRAFT_BRANCHES = 8
#: The default edge mode (the edge daemon's settings: γ and D auto, pre-drafting on, its
#: branches sent to the verifier).
DEFAULT_EDGE = "auto:predraft"
#: Tokens a hedge carries after its rival token in the ``:hedge`` modes.
HEDGE_TOKENS = 3
_SAW = re.compile(r"^saw:(\d+)$")
_PIPE = re.compile(r"^pipe:(\d+)x(\d+)(:nocogen|:hedge)?$")
_AUTO = re.compile(r"^auto(:nocogen|:hedge|:predraft|:tree)?$")


def parse_mode(spec: str) -> ModeSpec:
    s = spec.strip()
    if s in ("hybrid", "hybrid:predraft", "hybrid:tree"):
        tree = s.endswith(":tree")
        predraft = PREDRAFT_BRANCHES if s != "hybrid" else 0
        return ModeSpec(
            s,
            Mode.PIPELINED,
            4,
            4,
            cogen=True,
            auto=True,
            predraft=predraft,
            tree=tree,
            cloud=CloudSide.SPEC,
        )
    if s in ("cloud-sd", "cloud-sd:ngram"):
        side = CloudSide.SPEC if s == "cloud-sd" else CloudSide.NGRAM
        return ModeSpec(s, Mode.PIPELINED, 4, 4, cogen=True, cloud=side, edge_draft=False)
    if m := _AUTO.match(s):
        opt = m.group(1)
        hedge = HEDGE_TOKENS if opt == ":hedge" else 0
        predraft = PREDRAFT_BRANCHES if opt in (":predraft", ":tree") else 0
        return ModeSpec(
            s,
            Mode.PIPELINED,
            4,
            4,
            cogen=opt != ":nocogen",
            auto=True,
            hedge=hedge,
            predraft=predraft,
            tree=opt == ":tree",
        )
    if m := _SAW.match(s):
        return ModeSpec(s, Mode.STOP_AND_WAIT, int(m.group(1)), 1, cogen=False)
    if m := _PIPE.match(s):
        opt = m.group(3)
        return ModeSpec(
            s,
            Mode.PIPELINED,
            int(m.group(1)),
            int(m.group(2)),
            cogen=opt != ":nocogen",
            hedge=HEDGE_TOKENS if opt == ":hedge" else 0,
        )
    raise ValueError(
        f"bad mode {spec!r}: expected saw:G, pipe:GxD[:nocogen|:hedge], "
        "auto[:nocogen|:hedge|:predraft|:tree], "
        "hybrid[:predraft|:tree], cloud-sd or cloud-sd:ngram"
    )


def parse_modes(text: str) -> tuple[ModeSpec, ...]:
    modes = tuple(parse_mode(x) for x in text.split(",") if x.strip())
    for m in modes:
        m.pipeline_config()  # validates γ and D
    labels = [m.label for m in modes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"modes {text!r} repeat a mode")
    return modes
