"""A TorchRL environment whose every step says where it came from, for the compat tests.

``obs = [ident, episode, t, check]`` with ``check = ident * 7919 + episode * 104729 + t``:
a sampled slice that mixes two trajectories, skips a step, or holds a torn
row shows it.  Episodes last ``length`` steps and end with ``done``.
"""
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Composite, Unbounded
from torchrl.envs import EnvBase


def check_of(ident, episode, t):
    return ident * 7919 + episode * 104729 + t


class StepEnv(EnvBase):
    def __init__(self, ident: int = 0, length: int = 7):
        super().__init__(batch_size=torch.Size([]))
        self.ident, self.length = ident, length
        self.episode, self.t = -1, 0
        self.observation_spec = Composite(obs=Unbounded(shape=(4,), dtype=torch.int64))
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=(1,))
        self.reward_spec = Unbounded(shape=(1,))

    def _obs(self):
        return torch.tensor([self.ident, self.episode, self.t,
                             check_of(self.ident, self.episode, self.t)])

    def _reset(self, tensordict=None):
        self.episode += 1
        self.t = 0
        return TensorDict({"obs": self._obs(), "done": torch.zeros(1, dtype=torch.bool),
                           "terminated": torch.zeros(1, dtype=torch.bool)}, [])

    def _step(self, tensordict):
        self.t += 1
        done = torch.tensor([self.t >= self.length])
        return TensorDict({"obs": self._obs(), "reward": torch.ones(1), "done": done,
                           "terminated": done.clone()}, [])

    def _set_seed(self, seed):
        return seed


def make_env(ident: int, length: int = 7):
    return StepEnv(ident, length)
