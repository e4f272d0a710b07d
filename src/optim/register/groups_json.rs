//! `param_groups` as torch's `optimizer.state_dict()["param_groups"]` shows them, with
//! FlashOptim's extra entries and fo's format, parameters listed by FQN.
use serde_json::{json, Value};

use crate::optim::math::config::Algorithm;
use crate::optim::optimizer::Optimizer;

impl Optimizer {
    pub fn param_groups_json(&self) -> Value {
        let groups: Vec<Value> = self
            .groups()
            .iter()
            .enumerate()
            .map(|(g, c)| {
                let mut v = json!({
                    "algorithm": c.algorithm.name(),
                    "lr": c.lr,
                    "initial_lr": c.initial_lr,
                    "weight_decay": c.weight_decay,
                    "state_format": c.state_format.name(),
                    "master_weight_bits": c.master_weight_bits,
                    "master_bytewidth": c.master_weight_bits / 8,
                    "quantize": c.state_format.is_quantized(),
                    "check_numerics": c.check_numerics,
                    "arithmetic": c.arithmetic.name(),
                });
                let m = v.as_object_mut().unwrap();
                match c.algorithm {
                    Algorithm::AdamW | Algorithm::Adam => {
                        m.insert("betas".into(), json!([c.beta1, c.beta2]));
                        m.insert("eps".into(), json!(c.eps));
                        m.insert("decouple_lr".into(), json!(c.decouple_lr));
                    }
                    Algorithm::Sgd | Algorithm::SgdW => {
                        m.insert("momentum".into(), json!(c.momentum));
                        m.insert("dampening".into(), json!(c.dampening));
                        m.insert("nesterov".into(), json!(c.nesterov));
                        m.insert("decouple_lr".into(), json!(c.decouple_lr));
                    }
                    Algorithm::Lion => {
                        m.insert("betas".into(), json!([c.beta1, c.beta2]));
                        m.insert("decouple_lr".into(), json!(c.decouple_lr));
                    }
                }
                let params: Vec<&str> = self
                    .entries()
                    .iter()
                    .filter(|p| p.group() == g)
                    .map(|p| p.fqn())
                    .collect();
                m.insert("params".into(), json!(params));
                v
            })
            .collect();
        Value::Array(groups)
    }
}
