"""The one name rule: a Triton model's name from an export and a format, and back."""

from __future__ import annotations

import pytest

from torchship.names import SERVED_FORMATS, export_name, format_by_suffix, format_of, model_name, models_of


def test_a_model_name_reads_back_to_its_format_and_no_other_exports():
    m = {"name": "resnet50"}
    assert [format_of(model_name(m, f), m) for f in SERVED_FORMATS] == list(SERVED_FORMATS)
    assert models_of(m, ["resnet50_onnx", "resnet50_v2_onnx", "resnet50_aoti_buckets", "other_aoti", "resnet50_aoti"]) == \
        ["resnet50_onnx", "resnet50_aoti"]
    assert export_name("torchvision.models:resnet50") == export_name("resnet50") == "resnet50"
    with pytest.raises(ValueError, match="not served"):
        model_name(m, "exported_program")


def test_a_name_alone_reads_back_to_its_format():
    assert [format_by_suffix(f"my_net_{f}") for f in SERVED_FORMATS] == list(SERVED_FORMATS)
    assert format_by_suffix("my_net") is None and format_by_suffix("my_net_aoti_buckets") is None
