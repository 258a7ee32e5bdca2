"""The paper's model: the frozen model config (`config`), the Transformer (`models`), multi-head
attention (`attention`), the label-smoothed loss and metrics (`losses`) and FLOP counts
(`flops`). What is written for speed on one platform lives in `kernels/`, behind calls that
name what they compute."""
