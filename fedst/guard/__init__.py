"""GEN-Guard's correction step: Disagreement-Aware Distillation (DAD) at each site, after training.

    python -m fedst.guard RUN_DIR [--site A ...] [--epochs N]

GEN-Guard (papers/002, Sec. 3.3.2, Eq. 8-12) corrects a model-selection failure without new
federated rounds: the conventionally selected model f_CONV (rule ``mixed``, Eq. 6) is the student,
the client-blocked model f_CBE (rule ``cbe``, Eq. 7) the teacher, both rebuilt from the run's kept
validation snapshots (fedst/federation/snapshots.py). Both stay frozen; only a small residual
generator trains:

* Eq. 8: ``e = G_embed([E_CBE || E_CONV])``, G_embed a 2-layer MLP (2D -> hidden -> dist_dim) on
  the normalised embeddings of both models;
* Eq. 9: R_pred (2-layer MLP, dist_dim -> hidden -> D*K + K) generates W_res [D, K] and b_res [K]
  for the student's prediction layer: ``y_final = E_CONV (W_CONV + W_res) + (b_CONV + b_res)``;
* Eq. 10-12: ``L_DAD = w_agree L_agree + w_disagree L_disagree``; where the student's and the
  teacher's argmax differ, KL at T_dis plus a cosine term (Eq. 11); where they agree, KL at
  T_agree (Eq. 12); plus, at in-federation sites, a supervised cross-entropy on the site's labels.

Where it runs: at each site, on that site's own **validation** split only (never test), in this
process for every site of a run: each training site corrects its v_k (student v_k at the
``mixed`` round, teacher v_k at the ``cbe`` round, supervised term on), and the held-out site
(``selection.held_out_site``) corrects the out-of-federation model (zero-shot: no labels). The
out-of-federation sites (E, GraSP) have no validation split (fedst/data/splits.py), so they
cannot train a correction of their own: they are scored with the held-out site's corrected
out-of-federation model, which never saw them (the paper's zero-shot Out-Fed column). Each
correction is saved beside the site's models, ``<site state dir>/guard/dad.pt`` (generator
weights, the rules and rounds of student and teacher, settings and the loss history), and the
corrected models run with ``guard=dad``:

    python -m fedst.infer run=RUN_DIR site=A input=VIDEO guard=dad
    python eval_outfed.py run=RUN_DIR guard=dad

Test scores before and after DAD (:func:`guard_test_scores`) are measured by
``python -m fedst.report msf RUN_DIR`` only once corrections exist (the discipline of
fedst/runs/model_selection.py's evaluate_choices: nothing is tested before the correction is final).

Design notes (how we read the paper for a segmentation network):

* **Most abstract layer** = the features E [B, D, h, w] that feed the final 1x1 segmentation
  head (``FedSTNet.prediction_head``): in the decode-head placement (the default) CFFM's
  ``linear_pred2``, ``temporal.decode_head.classifier``, on the current frame's fused map before
  and after the temporal block (stride 8, D = 2 x ``network.decoder_dim``); in the encoder
  placement and without the temporal module ``decoder.head`` (stride 4, D =
  ``network.decoder_dim``). Every encoder stage, the temporal module and channel selection are
  fused in them, and the head is exactly
  the linear prediction layer (W_CONV [D, K], b_CONV [K]) of Eq. 9, so Eq. 9 is the network's own
  head plus a residual, applied at every pixel.
* **Sample** = the frame for Eq. 8-9, the pixel for Eq. 10-12. The paper gives each sample one
  vector E in R^embed_dim and one "distribution embedding" e_i: we pool E over the frame's pixels
  (mean, then L2-normalised per model) and generate one residual head per frame. Per-pixel
  embeddings would describe local content rather than the frame's distribution (site, lighting)
  and would turn the correction into a per-pixel dynamic convolution with D*K generated weights
  per pixel, far more capacity than a shallow post-hoc step fitted on a validation split. The
  predictions, and so the agree/disagree masks and the losses, are per pixel: a segmentation
  prediction is a class per pixel, and teacher and student disagree on some pixels of a frame.
* E_CONV in Eq. 9 is the student's raw head input (only Eq. 8 reads the normalised embeddings),
  and R_pred's last layer starts at zero, so before training y_final is exactly f_CONV's output.
* Loss conventions (the paper does not state them): KL is the distillation KL(p_teacher^T ||
  p_final^T) with p = softmax(logits / T) over the K classes, without a T^2 factor (the paper's
  formula has none); L_COS = 1 - cos(y_final, y_CBE) of the logit vectors (no temperature, as in
  Eq. 11); the masks come from the frozen models' argmax at the head's grid; the sums of Eq. 11-12
  run over the masks' pixels and Eq. 10 is divided by the batch's pixel count, a constant that
  keeps the paper's relative weighting of agree and disagree pixels. The supervised term is the
  cross-entropy of y_final upsampled to the labels' size (255 ignored), weight
  ``supervised_weight``.
* Early stopping: the last ``stop_fraction`` of a site's validation samples (dataset order: video
  by video, in time, so the held-back frames are a contiguous end) are not fitted; after every
  epoch the same objective (L_DAD, plus the supervised term where it is on) is measured on them,
  and training stops after ``patience`` epochs without improvement. The generator of the best
  epoch is kept; epoch 0 (the untrained generator, i.e. the student) is a candidate, so the
  correction never scores worse than the student on the held-back frames.
* Cost: the corrected model runs both networks (Eq. 8 reads the teacher's features of the same
  frame), about twice the student's inference cost, plus the generator (negligible).

The package reads top to bottom: ``correction.py`` (Eq. 8-12: the generator, the corrected head,
the loss, the corrected network), ``fitting.py`` (which corrections a run has, fitting DAD at a
site), ``scores.py`` (test scores before and after), ``cli.py`` (the command).

Layer: above fedst.runs.model_selection; imports fedst.runs, fedst.federation, fedst.runs.model_selection and below.
"""

from fedst.guard.cli import main
from fedst.guard.correction import (
    GuardConfig,
    GuardedNet,
    GuardError,
    ResidualHeadGenerator,
    corrected_logits,
    dad_loss,
    disagreement_mask,
)
from fedst.guard.fitting import guard_file, held_out_site, load_guarded_model, run_guard
from fedst.guard.scores import evaluate_guarded_sites, guard_test_scores, saved_corrections

__all__ = [
    "GuardConfig",
    "GuardError",
    "GuardedNet",
    "ResidualHeadGenerator",
    "corrected_logits",
    "dad_loss",
    "disagreement_mask",
    "evaluate_guarded_sites",
    "guard_file",
    "guard_test_scores",
    "held_out_site",
    "load_guarded_model",
    "main",
    "run_guard",
    "saved_corrections",
]
