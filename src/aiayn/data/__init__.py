"""Everything between text files and the training loop: vocabulary, binarised corpus, batches."""
