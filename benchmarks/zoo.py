"""The model zoo: every builder in ``benchmarks/models/`` with its size class, global batch
and the source of that batch.

``spec`` is a model spec in the form of DESIGN.md section 3 (``path/to/file.py:NAME``,
path relative to the repository root), so ``flexsearch plan <spec>`` and
``flexsearch.load_model(<spec>)`` accept it as is (run from the repository root, or
resolve it with :func:`path`).

Size classes: ``tiny`` = the ``*_tiny`` builders (real CPU weights, well under 1M
parameters, for multi-process equivalence tests) and the ``*_digits`` ones (real CPU
weights, shaped for scikit-learn's 8x8 digits: what D-PSGD convergence runs train); ``small`` < 100M parameters; ``medium`` 100M..2B and ``large`` > 2B. Every
configuration at a paper's full batch is built on the meta device (no memory); only the
tiny ones and resnet20 hold real CPU weights.

Batches marked "(approx.)" are a reading of the paper that could not be checked word for
word. Where a paper trains with a fixed per-GPU batch and scales it with the GPU count
(FlexFlow, PipeDream), the global batch here is that per-GPU batch x 16 GPUs, the size of
those papers' clusters (FlexFlow: 4 nodes x 4 P100; PipeDream: 4 x 4 V100 or 2 x 8 V100);
every builder takes ``batch_size=`` to change it.

Self-contained: imports only the standard library (the builders are loaded by path).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SIZES = ("tiny", "small", "medium", "large")

_FLEXFLOW = (
    "FlexFlow (Jia, Zaharia, Aiken, 'Beyond Data and Model Parallelism for Deep Neural "
    "Networks', SysML 2019): 64 per GPU x 16 GPUs (approx.)"
)
_PIPEDREAM = "PipeDream (Narayanan et al., SOSP 2019): minibatch 64 per GPU x 16 GPUs (approx.)"


@dataclass(frozen=True)
class ZooEntry:
    spec: str  # "benchmarks/models/<file>.py:<builder>", relative to the repository root
    family: str  # file stem: mlp, gpt, bert, alexnet, vgg, resnet, inception, rnn, nmt, dlrm
    size: str  # one of SIZES
    batch: int  # global batch of one iteration (dim 0 of the example inputs)
    source: str  # where the configuration and the batch come from

    @property
    def name(self) -> str:
        """The builder's name, e.g. ``gpt2_small``."""
        return self.spec.rsplit(":", 1)[1]

    @property
    def file(self) -> str:
        """The model file, relative to the repository root."""
        return self.spec.rsplit(":", 1)[0]

    @property
    def path(self) -> Path:
        """Absolute path of the model file."""
        return REPO_ROOT / self.file

    @property
    def abs_spec(self) -> str:
        """The spec with an absolute path, usable from any working directory."""
        return f"{self.path}:{self.name}"


def _e(file: str, name: str, size: str, batch: int, source: str) -> ZooEntry:
    return ZooEntry(f"benchmarks/models/{file}.py:{name}", file, size, batch, source)


ZOO: tuple[ZooEntry, ...] = (
    # --- mlp
    _e("mlp", "mlp", "medium", 1024, "synthetic 4 x 8192 square MLP (no paper); batch 1024 chosen"),
    _e("mlp", "mlp_tiny", "tiny", 16, "synthetic"),
    _e("mlp", "mlp_digits", "tiny", 32, "scikit-learn digits (64 pixels, 10 classes); batch 32 chosen"),
    # --- gpt
    _e(
        "gpt",
        "gpt2_small",
        "medium",
        512,
        "GPT-2 paper (Radford et al. 2019): 124M, batch 512 x 1024 tokens",
    ),
    _e(
        "gpt",
        "gpt2_medium",
        "medium",
        512,
        "GPT-2 paper (Radford et al. 2019): 355M, batch 512 x 1024 tokens",
    ),
    _e(
        "gpt",
        "gpt2_xl",
        "medium",
        512,
        "GPT-2 paper (Radford et al. 2019): 1.5B, batch 512 x 1024 tokens",
    ),
    _e(
        "gpt",
        "gpt3_175b",
        "large",
        1536,
        "GPT-3 paper (Brown et al. 2020, Table 2.1): 175B, batch 3.2M tokens ~ 1536 x 2048",
    ),
    _e("gpt", "gpt_tiny", "tiny", 8, "synthetic"),
    # --- bert
    _e(
        "bert",
        "bert_large",
        "medium",
        256,
        "BERT paper (Devlin et al. 2019): BERT-large, batch 256 x 512 tokens",
    ),
    _e("bert", "bert_tiny", "tiny", 8, "synthetic"),
    # --- alexnet
    _e("alexnet", "alexnet", "small", 1024, _FLEXFLOW),
    _e("alexnet", "alexnet_tiny", "tiny", 8, "synthetic"),
    # --- vgg
    _e("vgg", "vgg16", "medium", 1024, _PIPEDREAM),
    _e("vgg", "vgg_tiny", "tiny", 8, "synthetic"),
    # --- resnet
    _e(
        "resnet",
        "resnet50",
        "small",
        256,
        "ResNet paper (He et al. 2016, section 3.4): mini-batch 256",
    ),
    _e("resnet", "resnet101", "small", 1024, _FLEXFLOW),
    _e(
        "resnet",
        "resnet20",
        "small",
        128,
        "D-PSGD (Lian et al., NeurIPS 2017) ResNet-20 on CIFAR-10; batch 128 as He et al. "
        "2016 section 4.2 (approx.)",
    ),
    _e("resnet", "resnet_tiny", "tiny", 8, "synthetic"),
    _e("resnet", "resnet20_digits", "tiny", 32,
       "ResNet-20 (as resnet20) at scikit-learn digits' 8x8 resolution, 3 channels; batch 32 chosen"),
    # --- inception
    _e("inception", "inception_v3", "small", 1024, _FLEXFLOW + "; auxiliary classifier omitted"),
    _e("inception", "inception_tiny", "tiny", 4, "synthetic (Inception-v3 blocks at width 1/16)"),
    # --- rnn
    _e(
        "rnn",
        "rnntc",
        "medium",
        1024,
        _FLEXFLOW + "; sizes (approx.) from FlexFlow's RNN artifact: hidden/embed 2048, 40 steps",
    ),
    _e(
        "rnn",
        "rnnlm",
        "medium",
        1024,
        _FLEXFLOW + "; sizes (approx.) from FlexFlow's RNN artifact: hidden/embed 2048, 40 steps",
    ),
    _e("rnn", "rnntc_tiny", "tiny", 8, "synthetic"),
    _e("rnn", "rnnlm_tiny", "tiny", 8, "synthetic"),
    # --- nmt
    _e(
        "nmt",
        "nmt",
        "medium",
        1024,
        _FLEXFLOW + "; sizes (approx.) from FlexFlow's nmt.cc: hidden/embed 2048, vocab 20K",
    ),
    _e("nmt", "gnmt8", "medium", 1024, _PIPEDREAM + "; GNMT-8 = 4+4 LSTM layers of 1024"),
    _e("nmt", "gnmt16", "medium", 1024, _PIPEDREAM + "; GNMT-16 = 8+8 LSTM layers of 1024"),
    _e("nmt", "nmt_tiny", "tiny", 4, "synthetic (GNMT-style, 3+3 layers)"),
    # --- dlrm
    _e(
        "dlrm",
        "dlrm",
        "large",
        2048,
        "DLRM (Naumov et al. 2019) MLPerf Criteo Terabyte config; batch 2048 as the MLPerf "
        "reference run (facebookresearch/dlrm bench/run_and_time.sh)",
    ),
    _e("dlrm", "dlrm_tiny", "tiny", 16, "synthetic"),
)

FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(e.family for e in ZOO))


def entries(size: str | None = None, family: str | None = None) -> list[ZooEntry]:
    """The zoo entries, optionally filtered by size class and/or family."""
    if size is not None and size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return [
        e
        for e in ZOO
        if (size is None or e.size == size) and (family is None or e.family == family)
    ]


def get(name: str) -> ZooEntry:
    """The entry of one builder, by name (``"gpt2_small"``) or spec."""
    for e in ZOO:
        if name in (e.name, e.spec):
            return e
    raise KeyError(f"no zoo entry {name!r}")


def load_module(entry: ZooEntry):
    """Import the entry's model file by path (model files are not a package)."""
    mod_name = f"_flexsearch_zoo_{entry.family}"
    spec = importlib.util.spec_from_file_location(mod_name, entry.path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {entry.path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return module


def build(entry: ZooEntry | str, **kwargs):
    """Call the entry's builder: returns ``(nn.Module, example_inputs)``."""
    if isinstance(entry, str):
        entry = get(entry)
    return getattr(load_module(entry), entry.name)(**kwargs)
