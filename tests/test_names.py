"""The one name rule: a Triton model's name from an export and a format, and back."""

from __future__ import annotations

import pytest

from torchship.names import SERVED_FORMATS, export_name, format_of, model_name, models_of


def test_a_model_name_reads_back_to_its_format_and_no_other_exports():
    m = {"name": "resnet50"}
    assert [format_of(model_name(m, f), m) for f in SERVED_FORMATS] == list(SERVED_FORMATS)
    assert models_of(
        m, ["resnet50_onnx", "resnet50_v2_onnx", "resnet50_aoti_buckets", "other_aoti", "resnet50_aoti"]
    ) == ["resnet50_onnx", "resnet50_aoti"]
    assert export_name("torchvision.models:resnet50") == export_name("resnet50") == "resnet50"
    with pytest.raises(ValueError, match="not served"):
        model_name(m, "exported_program")


def test_a_name_alone_reads_back_to_its_format():
    assert [format_of(f"my_net_{f}") for f in SERVED_FORMATS] == list(SERVED_FORMATS)
    assert format_of("my_net") is None and format_of("my_net_aoti_buckets") is None


def test_a_recorded_format_wins_over_the_name():
    """A model served under the export's plain name has no format in its name; its config records one."""
    from tritonclient.grpc import model_config_pb2 as mc

    m = {"name": "resnet50"}
    as_json = {"parameters": {"torchship_format": {"string_value": "onnx_int8"}}}
    proto = mc.ModelConfig(name="resnet50")
    proto.parameters["torchship_format"].string_value = "aoti"
    assert format_of("resnet50", m) is None
    assert format_of("resnet50", m, as_json) == "onnx_int8" and format_of("resnet50", config=proto) == "aoti"
    assert format_of("resnet50_onnx", m, {"parameters": {}}) == "onnx"
