"""LLaMA-Factory 0.9: the adapter (:mod:`.adapter`), every ``mm_plugin`` media read run
stock in the sandbox (:mod:`.decode`), bad rows dropped at preprocessing and
substituted at collation (:mod:`.rows`), and the workers' start method and the
collator's model as a meta copy (:mod:`.workers`)."""
