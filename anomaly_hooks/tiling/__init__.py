"""High-resolution inspection: a working frame of the images' own aspect, cut into overlapping
tiles at the backbone input, their features stitched into one grid per image.

* :mod:`~anomaly_hooks.tiling.config` — the ``tiling:`` section.
* :mod:`~anomaly_hooks.tiling.frame` — the working frame from the training images' size.
* :mod:`~anomaly_hooks.tiling.grid` — tile positions, cutting and stitching.
* :mod:`~anomaly_hooks.tiling.pipeline` — :class:`Tiling`, the steps the detector calls.
* :mod:`~anomaly_hooks.tiling.detector` — the detector's seams (attach, fit, model info).
"""
