"""Graph passes over torch.fx, installed as ``autosplit.passes`` (DESIGN §3)."""

__all__ = []
