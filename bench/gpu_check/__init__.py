"""The prepared GPU check: every GPU-relevant measurement of FedST in one call of at most 9
minutes, on a borrowed machine with one H100 (or H200), 16 cores, no network and a ``python3``
that already holds torch 2.11, timm, onnx, onnxruntime, OpenCV, matplotlib, TensorBoard and
pytest; rehearsed here on the CPU under that machine's conditions.

    make gpu-wheels                              # here: the wheels that machine lacks, into .whl/
    bash bench/gpu_check/gpu_check.sh            # there, from the repository root: report in $OUT
    bash bench/gpu_check/gpu_check.sh --cpu      # anywhere: the same steps on the CPU, reduced
    make gpu-rehearsal                           # here: --cpu in an environment laid out as there
    python -m bench.gpu_check --help             # the driver's subcommands

The modules:

* ``gpu_check.sh``: the shell entry. A CUDA pre-flight (exit 3 with the reason), the carried
  wheels installed with ``pip --target`` and put on PYTHONPATH, the package list and unmet
  requirements written to $OUT, then ``python -m bench.gpu_check run``.
* ``__main__.py`` / ``check.py``: the driver: device facts, pre-flight, the steps in order within
  the overall budget, the report rewritten after every step (a run cut off still returns what it
  measured); exits non-zero when any step did not end ok.
* ``plan.py``: the steps, their sizes (``GPU_SIZES``; ``CPU_SIZES`` for ``--cpu``) and time limits
  (``STEP_LIMITS_S``), and the device tool's timeout for the call (``RUN_TIMEOUT_S``).
* ``runner.py``: one step: its commands in order under its time limit, in a process group of its
  own, nvidia-smi sampled meanwhile.
* ``timing.py``: the ``step`` (one training step, the options against the fp32 eager baseline, in
  one process) and ``stream`` (streaming inference FPS) benchmarks.
* ``schedule.py``: the ``schedule`` step (issue 60, item 6): a site round at 5, 20 and 60 local
  iterations (fixed cost F and per-iteration cost t by least squares), the loader wait per call,
  CUDA-event step times, the GPU busy fraction (profiler kernel time / wall over steady
  iterations) in eager and reduce-overhead, compile from a cold model in default and
  reduce-overhead, the steady iterations under ``torch.cuda.set_sync_debug_mode("error")``, SERQ
  per batch, pre-training per iteration, one evaluation, and the paper's schedule computed from
  these units with each term listed. On the CPU every CUDA-only figure reads "not measured: no
  CUDA"; the fit and the arithmetic run.
* ``wheels.py``: the wheels the machine lacks (pinned to ``.venv``'s versions) and the check of
  their requirements against the machine's recorded versions.
* ``rehearsal.py``: the check run here as that machine runs it (a bare environment, the machine's
  packages linked, the wheels on PYTHONPATH only).

Steps, in order (each its own limit, ``STEP_LIMITS_S``, inside the budget: 490 s on a GPU):
``facts`` (torch, CUDA, card, dtype, TF32, package versions); ``federation`` (a tiny federation on
the device with ``train_fed.py``, then ``eval_outfed.py`` and ``fedst.infer``, checking that the
device was really used); ``schedule`` (schedule.py, above); ``tests`` (the CUDA-relevant tests
with ``FEDST_TEST_DEVICE=cuda``); ``scoring`` (evaluation's pixel counts on the device); ``step``
(one training step, batch 2 of 4-frame clips at 512x640, with none of the options against TF32,
bf16, channels_last and torch.compile, in one process, so the ratios come from one run);
``stream`` (streaming inference FPS at 512x640: eager fp32, bf16 and fp16 autocast, compiled,
CUDA graphs, and ONNX Runtime with its CUDA provider where present). With ``--cpu`` only (they do
not fit the GPU lease, see ``GPU_SIZES``): ``paper_scale`` (``bench.paper_scale --tiny-data``, a
training run of paper.yaml's settings: ms per site step, SERQ's, the loader's and the
evaluation's shares, peak memory), ``paper_scale_baseline`` (fp32, no TF32, no compile, no
channels_last) and ``paper_scale_options`` (``train.compile`` and ``train.channels_last`` on).

After every step ``gpu_check.md`` and ``gpu_check.json`` are rewritten and every command's output
is appended to ``gpu_check.log``, so a run cut off at any point still returns what it measured.
A step whose override names a config field this checkout does not have is ``unsupported``.

``--cpu`` runs the same steps on the CPU: 64x80 instead of 512x640, paper_scale's rounds of 1
iteration, the schedule's rounds (5, 20, 60) in mode none only, a few timed iterations, torch.compile with the ``eager`` backend (dynamo's tracing without
inductor's C++ build, which takes minutes on 2 cores) and only test_devices.py and this check's
own device tests, so tests/test_gpu_check.py can run the script in CI-sized time.
"""
