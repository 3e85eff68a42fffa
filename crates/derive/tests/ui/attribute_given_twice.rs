#![allow(dead_code)]

// The last would win, silently.
#[derive(shardline_derive::Entity)]
#[shardline(table = "photos")]
#[shardline(table = "comments")]
struct Photo {
    id: i64,
    #[shardline(user)]
    user_id: i64,
}

#[derive(shardline_derive::Entity)]
#[shardline(table = "likes")]
struct Like {
    id: i64,
    #[shardline(user, user)]
    user_id: i64,
}

#[derive(shardline_derive::Entity)]
#[shardline(table = "comments")]
struct Comment {
    id: i64,
    #[shardline(column = "photo", column = "photo_id")]
    photo_id: i64,
}

fn main() {}
