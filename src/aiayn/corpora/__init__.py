"""Where corpora come from, before the data path (aiayn/data) reads them:

demo.py       the corpora the project generates: the demos' and the tests' (`aiayn demo-data`)
catalog.py    the recipes' public corpora: files, pinned URLs, sha256, and where a recipe
              reads them (../shared/data or data/corpora)
download.py   `aiayn data download`: those files fetched and checked
"""
