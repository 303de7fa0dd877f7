"""load_model: the model-file convention and each bad-input case of DESIGN section 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexsearch import ModelLoadError, load_model

GOOD = """
import torch
from torch import nn

def build_model():
    return nn.Linear(4, 2), (torch.randn(3, 4),)

def other():
    return nn.Linear(4, 3)

def example_inputs():
    return torch.randn(5, 4)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)
"""


def test_default_name_and_inputs_from_builder(model_file):
    model, inputs = load_model(str(model_file(GOOD)))
    assert isinstance(model, nn.Linear) and model.out_features == 2
    assert inputs[0].shape == (3, 4)


def test_named_builder_takes_inputs_from_file(model_file):
    model, inputs = load_model(f"{model_file(GOOD)}:other")
    assert model.out_features == 3
    assert inputs[0].shape == (5, 4)


def test_module_class_constructed_without_arguments(model_file):
    model, _ = load_model(f"{model_file(GOOD)}:Model")
    assert model.fc.out_features == 1


def test_default_names_order(model_file):
    path = model_file(
        """
        import torch
        from torch import nn
        def get_model():
            return nn.Linear(2, 7)
        def get_inputs():
            return (torch.zeros(1, 2),)
        """
    )
    model, inputs = load_model(path)
    assert model.out_features == 7 and isinstance(inputs, tuple)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "absent.py"))


def test_not_a_python_file(tmp_path):
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="not a .py file"):
        load_model(str(tmp_path / "m.txt"))


def test_import_failure_shows_error_and_line(model_file):
    path = model_file(
        """
        import torch

        x = 1
        raise RuntimeError("boom in user code")
        """
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    msg = str(info.value)
    assert "RuntimeError: boom in user code" in msg
    assert f"{path}:5" in msg
    assert "\n" not in msg


def test_syntax_error_shows_line(model_file):
    path = model_file("def build_model(:\n    pass\n")
    with pytest.raises(ModelLoadError, match=r"SyntaxError.*:1"):
        load_model(path)


def test_no_model_found_lists_names(model_file):
    path = model_file("import torch\nX = 1\n")
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    for name in ("build_model", "get_model", "model", "Model"):
        assert name in str(info.value)


def test_unknown_name_lists_candidates(model_file):
    with pytest.raises(ModelLoadError, match=r"has no 'nope'.*build_model.*other"):
        load_model(f"{model_file(GOOD)}:nope")


def test_missing_example_inputs(model_file):
    path = model_file("from torch import nn\ndef build_model():\n    return nn.Linear(2, 2)\n")
    with pytest.raises(ModelLoadError, match=r"no example inputs.*example_inputs\(\)"):
        load_model(path)


def test_builder_returning_garbage(model_file):
    path = model_file("def build_model():\n    return 42\n")
    with pytest.raises(ModelLoadError, match="not an nn.Module"):
        load_model(path)


def test_builder_raising_reports_its_line(model_file):
    path = model_file("def build_model():\n    raise ValueError('bad config')\n")
    with pytest.raises(ModelLoadError, match=r"ValueError: bad config.*:2"):
        load_model(path)


def test_inputs_without_tensors(model_file):
    path = model_file("from torch import nn\ndef build_model():\n    return nn.Linear(2, 2), (3,)\n")
    with pytest.raises(ModelLoadError, match="hold no tensor"):
        load_model(path)


def test_model_path_with_colon_in_directory(tmp_path):
    d = tmp_path / "a:b"
    d.mkdir()
    (d / "m.py").write_text("import torch\nfrom torch import nn\ndef build_model():\n    return nn.Linear(1, 1), (torch.zeros(1, 1),)\n")
    model, _ = load_model(str(d / "m.py"))
    assert isinstance(model, nn.Linear)
    assert torch.is_tensor(_[0])


CTRL_C = "os.kill(os.getpid(), signal.SIGINT)\nfor _ in range(200):\n    time.sleep(0.01)\n"
"""A Ctrl-C that comes while the code runs: SIGINT to this process, then work for up to 2 s."""


@pytest.mark.parametrize("where", ["import", "builder", "inputs"])
def test_ctrl_c_while_the_model_builds_is_an_interrupt_not_a_load_error(model_file, where):
    """A Ctrl-C (SIGINT) while the file imports, its builder runs (a large model on real
    memory takes a while) or its inputs are made ends the load as an interrupt (the CLI:
    "interrupted", exit 130), not as a load error blaming the file; a KeyboardInterrupt
    the code raises itself stays one (below). The handler in place is restored."""
    import signal
    import textwrap

    body = {"import": CTRL_C, "builder": "", "inputs": ""}[where]
    build = textwrap.indent(CTRL_C, "    ") if where == "builder" else ""
    make = textwrap.indent(CTRL_C, "    ") if where == "inputs" else ""
    path = model_file("import os, signal, time\nimport torch\nfrom torch import nn\n" + body
                      + "def build_model():\n" + build + "    return nn.Linear(2, 2)\n"
                      + "def example_inputs():\n" + make + "    return (torch.zeros(1, 2),)\n")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_model(str(path))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(("source", "needle"), [
    ("import sys\nsys.exit(3)\n", "exits (sys.exit(3)) when imported"),
    ("raise SystemExit\n", "exits (sys.exit(None)) when imported"),
    ("raise KeyboardInterrupt\n", "raises KeyboardInterrupt when imported"),
])
def test_a_file_that_ends_the_process_at_import(model_file, source, needle):
    """Script code at module level (an exit, a Ctrl-C) is a load error naming the file,
    not the end of the process."""
    path = model_file(source)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    msg = str(e.value)
    assert needle in msg and str(path) in msg and "\n" not in msg and "__main__" in msg


def test_a_builder_that_exits(model_file):
    path = model_file("import sys\n\ndef build_model():\n    sys.exit(0)\n")
    with pytest.raises(ModelLoadError, match="exits"):
        load_model(str(path))


def test_a_builder_or_forward_that_raises_is_named_as_such(model_file):
    """A builder that raises says so and where, without "it must be callable without
    arguments" (kept for a builder that wants arguments); a forward that raises on the
    example inputs is not blamed on control flow."""
    from flexsearch import TraceError, trace

    path = model_file(
        """
        import torch
        from torch import nn

        def broken():
            raise RuntimeError("the config file is missing")

        def wants(width):
            return nn.Linear(width, 2)

        class Fails(nn.Module):
            def forward(self, x):
                raise ValueError("forward exploded")

        def failing():
            return Fails(), (torch.randn(2, 2),)
        """
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{path}:broken")
    assert "the config file is missing" in str(info.value) and "fix it there" in str(info.value)
    with pytest.raises(ModelLoadError, match="callable without arguments"):
        load_model(f"{path}:wants")
    with pytest.raises(TraceError) as info:
        trace(*load_model(f"{path}:failing"))
    assert "forward exploded" in str(info.value) and "control flow" not in str(info.value), str(info.value)


def test_a_dict_of_tensors_last_is_taken_as_keyword_inputs(model_file):
    """Inputs ending in a dict of tensors (passed by keyword) hold tensors (the file
    was refused: "hold no tensor"), as the Python API takes them."""
    path = model_file(
        """
        import torch
        from torch import nn

        class Two(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

            def forward(self, *, image, text):
                return self.a(image) + self.b(text)

        def build_model():
            return Two(), ({"image": torch.randn(8, 4), "text": torch.randn(8, 3)},)
        """
    )
    model, inputs = load_model(str(path))
    assert set(inputs[-1]) == {"image", "text"}


def test_a_dtype_clash_under_autocast_names_the_precision(model_file):
    """A tensor the model makes in fp32 meeting autocast's bf16 (a dispatch buffer of
    ``torch.zeros``): the error keeps the op's own words (it was cut to "scatter()") and
    says the mixed precision is why, with both fixes (it said to check the inputs)."""
    from flexsearch import TraceError, trace

    path = model_file(
        """
        import torch
        from torch import nn

        class Dispatch(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(8, 8)

            def forward(self, x):
                h = self.l(x)
                return torch.zeros(h.shape).scatter_add_(0, torch.zeros_like(h, dtype=torch.long), h)

        def build_model():
            return Dispatch(), (torch.randn(4, 8),)
        """
    )
    model, x = load_model(str(path))
    trace(model, x)  # fp32: fine
    with pytest.raises(TraceError) as info:
        trace(model, x, precision="bf16-mixed")
    msg = str(info.value)
    assert "scatter(): Expected self.dtype to be equal to src.dtype" in msg, msg
    assert "autocast to bfloat16" in msg and "--precision fp32" in msg and "example inputs" not in msg, msg
