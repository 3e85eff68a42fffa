#![allow(dead_code)]

// The derive reads the attributes, not the types: any type serves for an ID here.
type Id = i64;

#[derive(shardline_derive::Entity)]
#[shardline(table = "comments")]
struct Comment {
    id: Id,
    #[shardline(parent)]
    photo_id: Id,
    #[shardline(user)]
    user_id: i64,
    body: String,
}

fn main() {}
