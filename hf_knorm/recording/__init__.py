"""Norm recording: NormRecorder (attention-matrix Frobenius norms, K/V channel norms, read inside the attention) and
record_norms for any supported model, and the per-step recorder a Trainer's callback reduces across processes (per_step.py). May import models/, attention/ and below."""
