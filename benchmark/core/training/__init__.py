"""Training plumbing: the typed recipe, the data bundle, and the loop every training runs."""
from benchmark.core.training.loop import (
    FULL_PRECISION,
    Acceleration,
    LossFn,
    NonFiniteError,
    OptimizerChain,
    OptimizerFactory,
    StepCallback,
    TrainingData,
    TrainResult,
    accuracy,
    check_weights_finite,
    cross_entropy_loss,
    curve_subset,
    iterate_batches,
    learning_rate,
    make_optimizer,
    seeded,
    train_epoch,
    train_network,
)
from benchmark.core.training.potential import squared_norm, training_potential
from benchmark.core.training.recipe import FailRule, Plateau, Recipe, RecipeOverrides, Schedule

__all__ = [
    "FULL_PRECISION", "Acceleration", "LossFn", "NonFiniteError", "OptimizerChain", "OptimizerFactory", "StepCallback",
    "TrainingData", "TrainResult", "accuracy", "check_weights_finite",
    "cross_entropy_loss", "curve_subset", "iterate_batches", "learning_rate", "make_optimizer", "seeded", "train_epoch",
    "train_network", "squared_norm", "training_potential", "FailRule", "Plateau", "Recipe", "RecipeOverrides", "Schedule",
]
