"""Training recipes over the library, installed as `cachedemb.recipes` (this folder, mapped by pyproject's
package-dir as kernels/ is): `python -m cachedemb.recipes.dlrm.main --help`.

May import: the whole of `cachedemb` (its public names first); nothing in the library imports a recipe.
"""
