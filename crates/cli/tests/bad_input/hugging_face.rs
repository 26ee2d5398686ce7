//! Hugging Face model directories whose `config.json` asks for what the engine does not
//! implement: each refused naming the key.

use super::*;

/// A copy of the Llama-3.2-style fixture (as transformers 5 saved it) in `dir/name`, with
/// `edit` applied to its config.json.
fn edited_model(dir: &Path, name: &str, edit: impl Fn(&mut serde_json::Value)) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/tests/fixtures/hf/llama32");
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(src.join("model.safetensors"), out.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out.to_str().unwrap().to_string()
}

/// Every field that would change the model's math and is not implemented is refused naming
/// its key; the 4.x spellings and a sliding window as long as the context load.
#[test]
fn unsupported_hugging_face_fields_are_refused_naming_the_key() {
    use serde_json::json;
    let dir = scratch("hf-fields");
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let set = |k: &'static str, v: serde_json::Value| -> Edit {
        Box::new(move |c: &mut serde_json::Value| c[k] = v.clone())
    };
    let rope = |k: &'static str, v: serde_json::Value| -> Edit {
        Box::new(move |c: &mut serde_json::Value| c["rope_parameters"][k] = v.clone())
    };
    let refused: Vec<(&str, Edit, &'static str)> = vec![
        (
            "act",
            set("hidden_act", json!("gelu")),
            "`hidden_act` = \"gelu\"",
        ),
        (
            "yarn",
            rope("rope_type", json!("yarn")),
            "`rope_parameters.rope_type` = \"yarn\"",
        ),
        (
            "nofactor",
            Box::new(|c| {
                c["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("factor");
            }),
            "`rope_parameters.factor` is missing",
        ),
        (
            "partial",
            rope("partial_rotary_factor", json!(0.5)),
            "`partial_rotary_factor` = 0.5",
        ),
        (
            "abias",
            set("attention_bias", json!(true)),
            "`attention_bias` = true",
        ),
        ("mbias", set("mlp_bias", json!(true)), "`mlp_bias` = true"),
        // Qwen2 is read, with its q/k/v biases: Llama weights do not have them.
        (
            "qwen",
            set("model_type", json!("qwen2")),
            "no tensor `model.layers.0.self_attn.q_proj.bias`",
        ),
        (
            "layertypes",
            set(
                "layer_types",
                json!(["full_attention", "sliding_attention"]),
            ),
            "`layer_types` holds \"sliding_attention\"",
        ),
        (
            "gemma",
            set("model_type", json!("gemma")),
            "`model_type` = \"gemma\"",
        ),
        (
            "arch",
            set("architectures", json!(["GemmaForCausalLM"])),
            "`architectures`",
        ),
        // A head dimension is implemented; one the weights do not have is named.
        (
            "headdim",
            set("head_dim", json!(32)),
            "q_proj.weight` has shape [64, 64]",
        ),
        (
            "window",
            Box::new(|c| {
                c["model_type"] = json!("mistral");
                c["architectures"] = json!(["MistralForCausalLM"]);
                c["sliding_window"] = json!(8);
            }),
            "`sliding_window` = 8",
        ),
        (
            "dropout",
            set("attention_dropout", json!(0.1)),
            "`attention_dropout` = 0.1",
        ),
        (
            "jitter",
            set("router_jitter_noise", json!(0.01)),
            "`router_jitter_noise` = 0.01",
        ),
        (
            "softcap",
            set("final_logit_softcapping", json!(30.0)),
            "`final_logit_softcapping`",
        ),
        ("dtype", set("dtype", json!("int8")), "`dtype` = \"int8\""),
    ];
    let load = |model: &str, needle: &'static str, ok: bool| {
        let run = dir.join(format!("run-{}", model.len()));
        let args = [
            "train",
            "--quiet",
            "--init-from",
            model,
            "--set",
            "train.steps=0",
        ];
        let mut case = if ok {
            succeeds(&args, needle)
        } else {
            fails(&args, needle)
        };
        case.args.extend([
            "--set".into(),
            format!("run.dir={:?}", run.to_str().unwrap()),
        ]);
        case.args.push("--overwrite".into());
        case
    };
    let mut cases: Vec<Case> = refused
        .iter()
        .map(|(name, edit, needle)| load(&edited_model(&dir, name, edit), needle, false))
        .collect();
    // transformers 4.x spellings: rope_theta, torch_dtype and rope_scaling with "type".
    let v4 = edited_model(&dir, "v4", |c| {
        let p = c["rope_parameters"].take();
        c.as_object_mut().unwrap().remove("rope_parameters");
        let o = c.as_object_mut().unwrap();
        o.insert("rope_theta".into(), p["rope_theta"].clone());
        let mut scaling = p.clone();
        scaling.as_object_mut().unwrap().remove("rope_theta");
        scaling.as_object_mut().unwrap().remove("rope_type");
        scaling["type"] = json!("llama3");
        o.insert("rope_scaling".into(), scaling);
        let dtype = o.remove("dtype").unwrap();
        o.insert("torch_dtype".into(), dtype);
    });
    cases.push(load(&v4, "", true));
    let long_window = edited_model(&dir, "window64", |c| {
        c["model_type"] = json!("mistral");
        c["architectures"] = json!(["MistralForCausalLM"]);
        c["sliding_window"] = json!(64);
    });
    cases.push(load(&long_window, "", true));
    // Positions beyond the model's context are a warning, not an error.
    let mut long = load(&v4, "beyond the model's max_position_embeddings = 64", true);
    long.args
        .extend(["--set".into(), "model.seq_len=128".into()]);
    cases.push(long);
    check(&cases, &dir);
}
