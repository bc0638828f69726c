"""Norm recording: NormRecorder (attention-matrix Frobenius norms, K/V channel norms, read inside the attention) and
record_norms for any supported model. May import models/, attention/ and below."""
