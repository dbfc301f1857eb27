"""The benchmarks: each a script run from the repository root as ``python -m benchmarks.NAME``
(``--help`` says what it measures, ``--smoke`` runs its whole path in seconds on tiny data in a
temporary directory: a check that it runs, not a result). What they share (logs, finished runs
reused, medians and ranges, free ports, timing, the smoke mode's tiny data) is in
benchmarks/common.py. Each script says its group in a module constant, ``KIND``.

Experiments (``KIND = "experiment"``): they train models and report their quality.
- adapt_lm: full fine-tuning, LoRA, prefix and prompt tuning of a language model on Tiny Shakespeare
- bottleneck: BLEU against source length, RNN without and with attention and a Transformer
- digits_vit: a ViT on scikit-learn's digits beside an SVM, and its throughput against Hugging Face's
- fsdd: spoken digits: classification, each speaker left out, speech to text, a logistic regression
- gradient_distance: gradients over distance, an LSTM against self-attention
- head_seeds: per-head alignment error of the demo's Transformer for several seeds
- induction_heads: in-context learning and induction heads of a two-layer attention-only decoder
- listops: Long Range Arena's ListOps with each kind of attention
- lm_curve: learning curves of language-model runs, from their logs
- long_context: long-context language modelling with each attention kind, loss by position
- lora_transfer: LoRA against full fine-tuning and scratch, Multi30k En→De adapted to En→Fr
- moe: dense against mixture of experts on Tiny Shakespeare
- multi30k: Transformer-Tiny on Multi30k: train, average, evaluate on test2016
- positions: each kind of position, evaluated past its training length
- rnn_ladder: Multi30k De→En from an RNN without attention to the Transformer
- scaling: scaling laws of eight decoder sizes, fitted against size and compute
- sst2: BERT-style pretraining then SST-2, against SST-2 from scratch and LoRA
- table3: Table 3's ablations that a CPU can run, on Multi30k

Speed benchmarks (``KIND = "speed"``): they time (or weigh) what runs, on random weights or briefly
trained models.
- ab_versions: this checkout against another one, taking turns in one process
- bandwidth: the machine's memory read bandwidth, by a hand loop and by numpy (the wall of batch-1 decoding)
- compile_step: the fused decoding step against torch.compile of the plain one
- dropout: atencion's CPU dropout mask against torch's
- gpt2_recipe: configs/gpt2_124m.yaml for a few updates: tokens per second and MFU
- kv_cache: the key/value cache of grouped-query against multi-head attention
- long_attention: time and memory of one attention layer of each kind against the length
- matvec: the bandwidth of batch-1 products, torch's against atencion's kernels
- scale_out: FSDP against DDP on CPU processes, with and without activation checkpointing
- sequential: a training step's time against sentence length, RNN against Transformer
- serve_load: load test of `atencion serve`: latency, throughput, batching, overload
- serve_llm: atencion serve over the OpenAI protocol under streaming load, against llama.cpp's server
- speculative: speculative decoding's acceptance and speed-up
- speed: atencion against Hugging Face, CTranslate2 and llama.cpp, training and generation

benchmarks/multi30k_levers.sh (bash) scores a finished Multi30k run's decoding and averaging levers.
"""
