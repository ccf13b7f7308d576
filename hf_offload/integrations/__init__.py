"""What hf_offload knows of other libraries, read from what they leave on a model or in torch's
state, never by importing them: Liger Kernel (whether the loss is its fused linear
cross-entropy) and TRL (whether its own activation offloading is on around ours). The one
exception is `sequence_parallel`, a helper for DeepSpeed's Ulysses, which imports DeepSpeed when
one of its functions is called (never on `import hf_offload`)."""
