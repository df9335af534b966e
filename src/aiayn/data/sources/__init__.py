"""Where parallel text comes from; each source ends as plain ``PREFIX.{lang}`` files (one
sentence a line) that :func:`aiayn.data.prepare.prepare_data` reads like any user's files.

* :mod:`.download`: fetching into a cache directory and the file helpers the corpora share.
* :mod:`.bible`: the embedded English-Spanish Bible corpus, read from SWORD modules.
* :mod:`.bible_text`: its text, without I/O: markup cleaning, verse alignment, the fixed split.
* :mod:`.multi30k`: Multi30k task 1.
* :mod:`.wmt14`: the paper's WMT 2014 English-German data.
"""
