"""Kernels behind the model's plain calls, each named by what it computes: scaled dot-product
attention by the platform's kernel (`dot_product_attention`), the tied output layer's product
with its own backward (`tied_projection`), q/k/v as one product (`stacked_projection`), the
label-smoothed cross entropy with its own backward (`cross_entropy`), the post-norm
sub-layer's end as one Pallas kernel (`fused_norm`), and which kernel a platform gets
(`kernel_choice`)."""
