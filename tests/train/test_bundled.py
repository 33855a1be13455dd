"""The digits and sample photos read from scikit-learn's files are its loaders' own arrays, with or without the
files where this release keeps them, and reading them does not import scikit-learn."""

import subprocess
import sys

import numpy as np
import pytest

from torchship.train import bundled


def same_as_sklearn():
    from sklearn.datasets import load_digits, load_sample_images  # here: importing it costs every test worker 1 s

    images, target = bundled.digits()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert target.dtype == np.int64 and np.array_equal(target, bunch.target)
    photos, theirs = bundled.sample_photos(), load_sample_images().images
    assert len(photos) == len(theirs) == 2
    for mine, want in zip(photos, theirs):
        assert mine.dtype == np.uint8 and np.array_equal(mine, want)


def test_the_files_read_are_sklearns_arrays():
    assert bundled._sklearn_file("datasets", "data", "digits.csv.gz") is not None  # read from the file here
    same_as_sklearn()


def test_without_the_files_sklearns_loaders_give_them(monkeypatch):
    monkeypatch.setattr(bundled, "_sklearn_file", lambda *parts: None)
    same_as_sklearn()


@pytest.mark.parametrize("load", ["digits", "sample_photos"])
def test_reading_them_does_not_import_sklearn(load):
    code = f"import sys; from train import bundled; bundled.{load}(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
