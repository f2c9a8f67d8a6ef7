//! Model architectures. One file per family.
pub mod llama;
