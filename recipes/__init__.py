"""The shipped Hydra recipes, as package data: `modelpar_recipes` in an installed wheel, `recipes/` in a checkout."""
