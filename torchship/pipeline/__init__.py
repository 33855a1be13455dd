"""The top floor: the ``torchship`` CLI, ``torchship run`` (every stage in one run folder) and its summary.

The house has three floors, and imports only run down:
  torchship/            contracts every stage relies on (config, errors, io, checkpoint, images, eager,
                        signature, manifest, names, runtime, parity); they import no stage
  train/ export/ serve/ the stages, side by side; each imports torchship/ and never another stage
  torchship/pipeline/   drives the stages; nothing below imports it
tests/test_layers.py holds the house to this.
"""
