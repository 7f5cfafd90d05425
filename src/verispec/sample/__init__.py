"""Pure math: tensors in, tensors out, an explicit torch.Generator; no model, no I/O."""
