"""Everything that talks to torch.distributed lives here (apart from the DeepSpeed engine)."""
